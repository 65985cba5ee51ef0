"""The protocol's drop-ins for peer RL systems, each importing its peer system (and the core):

- ``staleflow_protocol.bindings.areal`` and ``.areal_trainer``: AReaL 1.0.4 (they import ``areal``);
- ``staleflow_protocol.bindings.verl``: verl 0.9's fully asynchronous trainer (standard library only).

Nothing here is imported by the core (``import staleflow_protocol`` needs nothing but the standard
library). See ``docs/integrating.md``.
"""
