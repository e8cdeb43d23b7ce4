"""Built-in acceptors: greedy, sampled (Leviathan/Chen), p-min (lossy). Each module registers itself
through the `register_acceptors` hook."""
