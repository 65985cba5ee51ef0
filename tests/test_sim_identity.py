"""The simulator's speed work changes no result: short runs give, to the last digit, what the code
before it gave (main at fa6b24f, 2026-12-07: the figures below were recorded there with this file's
runs). A workload of 24 instances whose KV cache binds, so that growth planning decides where
requests go and a coordinator tick plans for many instances in one pass (`kv_peak_growths`,
`row_sums`); ROLL Flash for the prompt-affinity path. The bit-exactness of the vectorised pieces is
pinned on their own in `tests/test_growth_and_tail.py`; this file pins the runs they decide."""

from __future__ import annotations

import pytest
from staleflow.app.simulation import simulate_system
from staleflow.runtime.settings.workload import load_workload

#: (system, eta, wide workload) -> the run's figures at fa6b24f (6 steps, seed 1, estimation error 0.1)
RECORDED = {
    ("staleflow", 1, True): {
        "virtual_s": 57.949999999998845,
        "step_times_s": [5.336864373499999, 15.237417121, 4.927399051000002, 10.803021749500012, 3.782432772500009, 17.820784155499993],
        "step_tokens": [35487, 64790, 51327, 55769, 52908, 57391],
        "staleness_histogram": {"0": 58, "1": 230},
        "wasted_tokens": 10949,
    },
    ("staleflow", 3, True): {
        "virtual_s": 29.11265652999999,
        "step_times_s": [3.9570166470000006, 2.213677497, 3.4094503515000003, 13.567011792500004, 1.4810799999999986, 4.4751769600000095],
        "step_tokens": [28428, 43438, 55657, 89112, 51766, 60822],
        "staleness_histogram": {"0": 48, "1": 48, "2": 56, "3": 136},
        "wasted_tokens": 3631,
    },
    ("roll-flash", 2, False): {
        "virtual_s": 56.24999999999894,
        "step_times_s": [5.344661116999999, 6.0790740025000005, 13.8854121085, 9.007141508500006, 8.501037761999982, 13.4192593295],
        "step_tokens": [10303, 15043, 22767, 18788, 20064, 18034],
        "staleness_histogram": {"0": 16, "1": 16, "2": 64},
        "wasted_tokens": 0,
    },
}


@pytest.mark.parametrize(("system", "eta", "wide"), sorted(RECORDED))
def test_a_short_run_gives_what_the_code_before_the_speed_work_gave(system: str, eta: int, wide: bool) -> None:
    base = load_workload("small-ci")
    workload = base.model_copy(update={
        "cluster": base.cluster.model_copy(update={"rollout_instances": 24}),
        "instance": base.instance.model_copy(update={"kv_capacity_tokens": 5000}),
        "batch": base.batch.model_copy(update={"groups_per_step": 48}),
    }) if wide else base
    figures = simulate_system(workload, system, eta, 6, seed=1, estimation_error=0.1)
    assert {key: figures[key] for key in RECORDED[system, eta, wide]} == RECORDED[system, eta, wide]
