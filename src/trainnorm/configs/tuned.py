"""Measured configurations, keyed by (H, activation element size in bytes).

Each entry carries, in a comment, the measurement that chose it (tools/tune.py
on an H200). Shapes absent here use the analytical defaults in __init__.py.
Changing an entry changes the bits of dw (the chunking) and possibly of dx
(the tile): it is a numerics change, to be re-verified with `trainnorm verify`.
"""
# (H, elt) -> FwdConfig fields
FWD: dict = {}
# (H, elt) -> BwdConfig fields
BWD: dict = {}
