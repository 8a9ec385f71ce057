"""Collectives never hand Python objects to the backend's worker threads.

Every backward stashes a Python object in the calling thread's torch state (autograd's
contextvars context), and a c10d Work copies that state. When a Gloo worker thread then drops
the last reference to such a Work, it must take the GIL; at interpreter exit it is ended there,
inside a noexcept destructor, and the process aborts ("terminate called without an active
exception"), as a 2-rank smoke run did about once in ten. The test stashes a probe the same way
and checks, over many collectives, that each probe dies in the thread that removed it, never
in a backend thread."""

from __future__ import annotations

import threading

import torch

import ulysses
from conftest import run_ranks

ROUNDS = 300  # Before the fix 39-57 of 300 probes were freed on a Gloo worker thread.


class Probe:
    def __init__(self, deaths: list):
        self.deaths = deaths

    def __del__(self):
        self.deaths.append(threading.get_ident())


def test_collectives_leave_no_python_object_to_backend_threads():
    def body(rank, group):
        me, deaths = threading.get_ident(), []
        x = torch.ones(1, 2, 3)
        for _ in range(ROUNDS):
            torch._C._stash_obj_in_tls("ulysses_test_probe", Probe(deaths))
            ulysses.all_gather_sequence(x, 1, [2, 2], group)
            torch._C._remove_obj_from_tls("ulysses_test_probe")
        for _ in range(100):  # A backend thread that still holds a probe frees it when it gets the GIL.
            if len(deaths) == ROUNDS:
                break
            threading.Event().wait(0.01)
        return len(deaths), sum(t != me for t in deaths)

    for died, elsewhere in run_ranks(2, body):
        assert died == ROUNDS
        assert elsewhere == 0, f"{elsewhere} of {ROUNDS} probes were freed on a backend thread"
