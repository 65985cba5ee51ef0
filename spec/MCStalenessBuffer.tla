------------------------- MODULE MCStalenessBuffer -------------------------
(* The absolute model for safety checking: the spec as written, with the   *)
(* head buffer bounded by MaxVersion (a CONSTRAINT: safety only).          *)
EXTENDS StalenessBuffer

CONSTANT MaxVersion

VersionBound == c <= MaxVersion
=============================================================================
