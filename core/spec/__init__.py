"""The speculation itself: the runner's loop, the drafter protocol and its chains, the draft-length policy,
the acceptance rules, and sampling with its position-coupled random streams. No file I/O, no model code."""
