"""Single-rank reference attention built from torch primitives only (not from ulysses)."""

from __future__ import annotations

import torch


def reference_attention(q, k, v, mask=None, positions=None, causal=False, window=0, softcap=0.0, sinks=None):
    """q [B, S, Hq, D], k/v [B, S, Hkv, D] (BSHD) -> [B, S, Hq, Dv], in float64.

    GQA by repeating kv heads; packed documents from position ids (a document starts where the
    position is 0); ``window`` > 0: query i sees keys i - window < j <= i; a query with no allowed
    key gets 0. ``softcap`` > 0: scores s become softcap * tanh(s / softcap) before the mask.
    ``sinks`` [Hq]: one more logit per head in each row's softmax, whose value is 0 (gpt-oss's).
    """
    B, S, Hq, D = q.shape
    r = Hq // k.shape[2]
    qf, kf, vf = (t.double().transpose(1, 2) for t in (q, k, v))
    kf, vf = kf.repeat_interleave(r, 1), vf.repeat_interleave(r, 1)
    s = qf @ kf.transpose(-1, -2) / D**0.5
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    allowed = torch.ones(S, S, dtype=torch.bool).expand(B, Hq, S, S)
    if causal:
        allowed = allowed & torch.ones(S, S, dtype=torch.bool).tril()
    if window:
        i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
        allowed = allowed & (i - j < window)
    if positions is not None:
        doc = (positions == 0).long().cumsum(-1)
        doc = doc if doc.dim() == 2 else doc.unsqueeze(0)
        allowed = allowed & (doc.unsqueeze(-1) == doc.unsqueeze(-2)).unsqueeze(1)
    if mask is not None:
        if mask.dtype == torch.bool:
            allowed = allowed & mask
        else:
            s = s + mask.double()
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double().view(1, Hq, 1, 1).expand(B, Hq, S, 1)], -1)
        vf = torch.cat([vf, vf.new_zeros(B, Hq, 1, vf.shape[-1])], -2)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return (p @ vf).transpose(1, 2)
