"""The protocol's drop-ins for peer RL systems, each importing its peer system (and the core):

- ``staleflow_protocol.bindings.areal`` and ``.areal_trainer``: AReaL 1.0.4 (they import ``areal``);
- ``staleflow_protocol.bindings.verl``: verl 0.9's fully asynchronous trainer's queue (standard library only),
  and ``.verl_dropin``: verl's ``fully_async_main`` with that queue (it imports ``verl`` and ``ray``).

Nothing here is imported by the core (``import staleflow_protocol`` needs nothing but the standard
library). See ``docs/integrating.md``.
"""
