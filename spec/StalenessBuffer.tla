--------------------------- MODULE StalenessBuffer ---------------------------
(***************************************************************************)
(* The staleness protocol of StaleFlow (design brief, section 2).          *)
(*                                                                         *)
(* c is the next buffer to consume (the trainer's next version is c + 1). *)
(* Each group g is idle (not active) or active with a version ver[g] (the  *)
(* oldest model that generated any of its tokens) and a status, running or *)
(* done. Its deadline is ver[g] + Eta: the last buffer it may be trained   *)
(* in. Group ids are reused: a consumed, dropped or aborted group becomes  *)
(* idle and may be reserved again as a new group.                          *)
(*                                                                         *)
(* batch is a ghost (history) variable: what the last step consumed and    *)
(* dropped, with the versions and statuses the groups had; NoBatch after   *)
(* any other step. It exists only to state S1 and S2.                      *)
(*                                                                         *)
(* spec/mirror.py is the executable Python copy of these actions; the two  *)
(* are checked equal state by state (verification/proofs/graph_equivalence.py).   *)
(***************************************************************************)
EXTENDS Integers, FiniteSets

CONSTANTS Eta,     \* staleness bound
          B,       \* groups per training batch
          X,       \* redundancy slack (groups that may be dropped per batch)
          Groups   \* group ids (model values)

ASSUME Eta \in Nat /\ B \in Nat \ {0} /\ X \in Nat /\ IsFiniteSet(Groups) /\ Groups # {}

Idle == "idle"
Running == "running"
Done == "done"
Status == {Idle, Running, Done}

NoBatch == [b |-> -1, taken |-> {}, dropped |-> {}]

VARIABLES c, ver, st, batch
vars == <<c, ver, st, batch>>

----------------------------------------------------------------------------
(* Operators over an explicit state (cc, vv, ss), so that guards can be    *)
(* evaluated on hypothetical states (with a group added, all finished...). *)

ActiveIn(ss) == {g \in Groups : ss[g] # Idle}
DoneIn(ss) == {g \in Groups : ss[g] = Done}

(* Inv for head cc, versions vv and active set A: no group past its        *)
(* deadline, and for k in 0..Eta at most (k+1)*B + X groups due by cc + k. *)
InvAt(cc, vv, A) ==
    /\ \A g \in A : vv[g] + Eta >= cc
    /\ \A k \in 0..Eta :
          Cardinality({g \in A : vv[g] + Eta <= cc + k}) <= (k + 1) * B + X

(* The groups a Consume that takes T drops: the others due at buffer cc.   *)
DroppedIn(cc, vv, ss, T) == {g \in ActiveIn(ss) \ T : vv[g] + Eta = cc}

(* T is a valid batch: B done groups, at most X drops, Inv at cc + 1.      *)
CanTakeIn(cc, vv, ss, T) ==
    /\ Cardinality(T) = B
    /\ T \subseteq DoneIn(ss)
    /\ Cardinality(DroppedIn(cc, vv, ss, T)) <= X
    /\ InvAt(cc + 1, vv, ActiveIn(ss) \ (T \cup DroppedIn(cc, vv, ss, T)))

CanConsumeIn(cc, vv, ss) == \E T \in SUBSET DoneIn(ss) : CanTakeIn(cc, vv, ss, T)

----------------------------------------------------------------------------
Active == ActiveIn(st)

TypeOK ==
    /\ c \in Nat
    /\ \A g \in Groups : ver[g] \in Nat /\ st[g] \in Status
    /\ \A g \in Groups : st[g] = Idle => ver[g] = 0
    /\ \A g \in Active : ver[g] <= c
    /\ batch.b \in Nat \cup {-1}

Inv == InvAt(c, ver, Active)

Init ==
    /\ c = 0
    /\ ver = [g \in Groups |-> 0]
    /\ st = [g \in Groups |-> Idle]
    /\ batch = NoBatch

(* Admit g generated from model v iff Inv still holds with g added.        *)
Reserve(g, v) ==
    /\ st[g] = Idle
    /\ v \in 0..c
    /\ InvAt(c, [ver EXCEPT ![g] = v], Active \cup {g})
    /\ ver' = [ver EXCEPT ![g] = v]
    /\ st' = [st EXCEPT ![g] = Running]
    /\ c' = c
    /\ batch' = NoBatch

Occupy(g) ==
    /\ st[g] = Running
    /\ st' = [st EXCEPT ![g] = Done]
    /\ UNCHANGED <<c, ver>>
    /\ batch' = NoBatch

Abort(g) ==
    /\ st[g] # Idle
    /\ st' = [st EXCEPT ![g] = Idle]
    /\ ver' = [ver EXCEPT ![g] = 0]
    /\ c' = c
    /\ batch' = NoBatch

(* Consume batch T, then subtract shift from the head and from every       *)
(* remaining version. The spec uses shift = 0; the relative (lag) model of *)
(* MCLag.tla uses shift = 1 once c = Eta, which keeps its state finite.    *)
ConsumeTake(T, shift) ==
    LET R == T \cup DroppedIn(c, ver, st, T) IN
    /\ CanTakeIn(c, ver, st, T)
    /\ c' = c + 1 - shift
    /\ st' = [g \in Groups |-> IF g \in R THEN Idle ELSE st[g]]
    /\ ver' = [g \in Groups |-> IF g \in R \/ st[g] = Idle THEN 0 ELSE ver[g] - shift]
    /\ batch' = [b |-> c,
                 taken |-> {<<g, ver[g], st[g]>> : g \in T},
                 dropped |-> {<<g, ver[g], st[g]>> : g \in DroppedIn(c, ver, st, T)}]

Consume == \E T \in SUBSET DoneIn(st) : ConsumeTake(T, 0)

Next ==
    \/ \E g \in Groups, v \in 0..c : Reserve(g, v)
    \/ \E g \in Groups : Occupy(g) \/ Abort(g)
    \/ Consume

Spec == Init /\ [][Next]_vars

----------------------------------------------------------------------------
(* S1 bound: every group of the last batch b has v <= b <= v + Eta.        *)
S1 == \A t \in batch.taken : t[2] <= batch.b /\ batch.b <= t[2] + Eta

(* S2 accounting: a batch has exactly B distinct done groups; they and the *)
(* dropped groups are no longer active; drops are groups due at b, at most *)
(* X of them, none when X = 0, and never also in the batch.                *)
S2 ==
    batch # NoBatch =>
        /\ Cardinality({t[1] : t \in batch.taken}) = B
        /\ Cardinality(batch.taken) = B
        /\ \A t \in batch.taken : t[3] = Done /\ st[t[1]] = Idle
        /\ \A t \in batch.dropped : t[2] + Eta = batch.b /\ st[t[1]] = Idle
        /\ {t[1] : t \in batch.taken} \cap {t[1] : t \in batch.dropped} = {}
        /\ Cardinality(batch.dropped) <= X
        /\ X = 0 => batch.dropped = {}

(* L1 (state form): if every running group finished now, Consume would be  *)
(* enabled as soon as at least B groups are active.                        *)
AllFinished == [g \in Groups |-> IF st[g] = Running THEN Done ELSE st[g]]
L1 == Cardinality(Active) >= B => CanConsumeIn(c, ver, AllFinished)

(* P1 exact admission: Reserve(g, v) is enabled iff the active groups and  *)
(* g can be placed in buffers c..deadline, at most B + X in the head       *)
(* buffer and B in each later one (checked by brute force at small bounds). *)
PlacementExists(cc, vv, A) ==
    /\ \A g \in A : vv[g] + Eta >= cc      \* every group has a buffer left (a necessary condition)
    /\ \E f \in [A -> cc..(cc + Eta)] :
          /\ \A g \in A : f[g] <= vv[g] + Eta
          /\ \A b \in cc..(cc + Eta) :
                Cardinality({g \in A : f[g] = b}) <= (IF b = cc THEN B + X ELSE B)

ExactAdmission ==
    \A g \in Groups, v \in 0..c :
        st[g] = Idle =>
            (ENABLED Reserve(g, v) <=> PlacementExists(c, [ver EXCEPT ![g] = v], Active \cup {g}))

(* Fairness for trainer progress: some running group eventually finishes, *)
(* a producer keeps reserving, the trainer consumes when it can.           *)
ProducerFairness == WF_vars(\E g \in Groups, v \in 0..c : Reserve(g, v))
RolloutFairness == WF_vars(\E g \in Groups : Occupy(g))
AnyAbort == \E g \in Groups : Abort(g)
=============================================================================
