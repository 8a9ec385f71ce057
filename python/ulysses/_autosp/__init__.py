"""The AutoSP rewrite behind ``ulysses.auto`` (private): its graph facts, op tables, the pass and
its handlers."""
