"""The proof layers of ``staleflow verify``: Z3 proofs, TLC model checking, the mirror against TLC's graph,
conformance, trace validation and mutants. They see only the protocol and the spec."""
