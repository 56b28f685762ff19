"""Training harness: a small decoder-only LM trained from scratch with dense attention, NSA, or
NSA with the reach backbone, on data that ships with Python itself (docs/quality.md)."""
