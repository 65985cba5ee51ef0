-------------------------------- MODULE MCLag --------------------------------
(***************************************************************************)
(* The relative (lag) model: finite without any CONSTRAINT, for liveness.  *)
(* Consume at c = Eta keeps c = Eta and lowers every version by one, so a  *)
(* state is the absolute state with all versions seen relative to the head *)
(* (deadline offsets), and c saturates at Eta (from then on no version     *)
(* below c - Eta is admissible, so the v >= 0 bound no longer matters).    *)
(* The map (c, ver) |-> (min(c, Eta), ver - max(0, c - Eta)) takes the     *)
(* spec's steps to this model's steps; graph_equivalence.py checks that    *)
(* this model's graph equals the mirror's graph under that map.            *)
(***************************************************************************)
EXTENDS StalenessBuffer

LagConsume == \E T \in SUBSET DoneIn(st) : ConsumeTake(T, IF c = Eta THEN 1 ELSE 0)

LagNext ==
    \/ \E g \in Groups, v \in 0..c : Reserve(g, v)
    \/ \E g \in Groups : Occupy(g) \/ Abort(g)
    \/ LagConsume

LagTypeOK == TypeOK /\ c <= Eta

(* Fairness written out: a producer keeps reserving, running groups finish, *)
(* the trainer consumes whenever it continuously can.                       *)
LagSpec == Init /\ [][LagNext]_vars
           /\ ProducerFairness /\ RolloutFairness /\ WF_vars(LagConsume)

(* Trainer progress: once aborts stop, the trainer consumes infinitely often. *)
TrainerProgress == <>[][~AnyAbort]_vars => []<><<LagConsume>>_vars
=============================================================================
