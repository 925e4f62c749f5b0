"""The step-cost model: its features, the per-side online correction on synthetic step times,
and the start-up calibration's cache (keyed by model/device/tp/dtype). The fit: test_step_fit."""

from __future__ import annotations

import json
import math
import random
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from kvfleet.worker.engine.step_plan import SeqChunk, StepPlan
from kvfleet.worker.step_cost.calibration import CalibrationKey, load_or_calibrate, startup_plans
from kvfleet.worker.step_cost.host_lock import host_lock
from kvfleet.worker.step_cost.model import CostModel, StepCost, attended, plan_shape

TRUE = CostModel(0.01, 0.001, 0.002, "synthetic", 1e-6)


def plan(*chunks: tuple[int, int]) -> StepPlan:
    """Chunks as (new tokens, computed tokens)."""
    return StepPlan(tuple(SeqChunk(f"r{i}", (5,) * n, c, tuple(range(64)))
                          for i, (n, c) in enumerate(chunks)))


def test_shape_counts_decode_rows_prefill_tokens_and_positions_attended():
    assert attended(0, 1) == 1 and attended(9, 1) == 10  # a decode row: its context
    assert attended(4, 3) == 7                            # a chunk reads its prefix and itself
    assert plan_shape(plan((100, 0), (20, 900), (1, 50))) == (1, 120, 100 + 920 + 51, 0)
    assert plan_shape(StepPlan(())) == (0, 0, 0, 0)
    verify = SeqChunk("v", (5,) * 5, 40, tuple(range(4)), num_draft_tokens=4)
    # a decode row carrying 4 drafts: one decode row and 4 drafts, not a 5-token prefill
    assert plan_shape(StepPlan(plan((1, 50)).chunks + (verify,))) == (2, 0, 51 + 45, 4)


def test_draft_term_prices_verify_steps_and_learns_on_its_own_side():
    """A prior without a draft term prices a draft as a prefill token; verify steps measured
    dearer correct the draft side, while the prefill side keeps its price."""
    cost = StepCost(TRUE, alpha=0.2)
    assert cost.prior.draft_token_s == TRUE.prefill_token_s
    assert cost.predict_step_s(1, 0, 105, 4) == pytest.approx(TRUE.predict_step_s(1, 0, 105) + 0.004)
    real = replace(TRUE, draft_token_s=0.003)
    for shape in [(1, 0, 105, 4), (4, 0, 420, 8), (2, 64, 300, 0), (1, 0, 101, 0)] * 100:
        cost.observe(shape, real.predict_step_s(*shape))
    assert cost.draft_scale == pytest.approx(3.0, rel=0.05)
    assert (cost.decode_scale, cost.prefill_scale) == pytest.approx((1.0, 1.0), abs=0.05)


def test_prediction_is_the_linear_form_and_loads_older_files(tmp_path):
    p = plan((100, 0), (1, 50))
    want = 0.01 + 0.002 * 1 + 0.001 * 100 + 1e-6 * (100 + 51)
    assert TRUE.step_seconds(p) == pytest.approx(want)
    assert TRUE.predict_step_s(0, 0, 0) == 0.0
    assert TRUE.scaled(2).step_seconds(p) == pytest.approx(2 * want)
    path = tmp_path / "old.json"  # written before the context term existed
    path.write_text('{"cost_model": {"step_base_s": 1, "prefill_token_s": 2, "decode_token_s": 3}}')
    assert CostModel.load(path).context_token_s == 0.0
    assert CostModel.from_json(TRUE.to_json()) == TRUE
    with pytest.raises(ValueError, match=">= 0"):
        CostModel(0.1, 0.0, 0.0, "", -1.0)


def test_a_step_past_the_few_row_kernel_pays_the_gemm_term():
    """The GEMM-path term applies to steps of more than ``few_rows`` query rows (decode rows,
    prefill tokens and drafts together), scales with the model and survives a round trip;
    without ``few_rows`` (GPUs, older files) it never applies."""
    two = replace(TRUE, gemm_step_s=0.005, few_rows=64)
    assert two.step_seconds(plan((60, 0), (1, 9), (1, 9), (1, 9), (1, 9))) == pytest.approx(
        TRUE.step_seconds(plan((60, 0), (1, 9), (1, 9), (1, 9), (1, 9))))  # 64 rows: the kernel
    past = plan((61, 0), (1, 9), (1, 9), (1, 9), (1, 9))  # 65 rows: the GEMM path
    assert two.step_seconds(past) == pytest.approx(TRUE.step_seconds(past) + 0.005)
    assert two.predict_step_s(60, 0, 600, 5) == pytest.approx(TRUE.predict_step_s(60, 0, 600, 5) + 0.005)
    assert two.scaled(2).few_rows == 64 and two.scaled(2).gemm_step_s == pytest.approx(0.01)
    assert CostModel.from_json(two.to_json()) == two
    assert replace(two, few_rows=0).step_seconds(past) == pytest.approx(TRUE.step_seconds(past))
    assert CostModel.from_json({"step_base_s": 1, "prefill_token_s": 2, "decode_token_s": 3}).few_rows == 0
    with pytest.raises(ValueError, match=">= 0"):
        replace(TRUE, gemm_step_s=-1.0)


def test_startup_plans_time_mixed_steps_on_both_sides_of_the_few_row_kernel():
    """The mixed steps an ITL target schedules (decode rows beside a 16- or 32-token chunk)
    run within the few-row kernel's reach; one more is just past it (the GEMM path), as are
    the larger prefill chunks, so the fit sees both paths."""
    from kvfleet.worker.runner.models.linear import FEW_ROWS

    shapes = [plan_shape(p) for p in startup_plans(400, 16, 2048, 1000)]
    mixed = [s for s in shapes if s.decode_rows and s.prefill_tokens]
    rows = [s.decode_rows + s.prefill_tokens + s.draft_tokens for s in shapes]
    assert [s.prefill_tokens for s in mixed] == [16, 32, FEW_ROWS]
    assert [s.decode_rows + s.prefill_tokens <= FEW_ROWS for s in mixed] == [True, True, False]
    assert sum(r > FEW_ROWS for r in rows) >= 3 and sum(r <= FEW_ROWS for r in rows) >= 8


def _shapes(rng: random.Random, n: int):
    for _ in range(n):
        rows = rng.randrange(1, 16)
        chunk = rng.choice([0, 16, 64, 256])
        ctx = rng.randrange(0, 2048)
        yield (rows, chunk, rows * (ctx + 1) + attended(rng.randrange(0, 1024), chunk))


def test_online_correction_converges_to_the_machines_speed_and_follows_drift():
    rng = random.Random(5)
    cost = StepCost(TRUE, alpha=0.05)
    for shape in _shapes(rng, 400):  # this machine is 1.8x slower than calibrated, ±10 % noise
        cost.observe(shape, TRUE.predict_step_s(*shape) * 1.8 * math.exp(rng.gauss(0, 0.1)))
    assert (cost.decode_scale, cost.prefill_scale) == pytest.approx((1.8, 1.8), rel=0.06)
    assert cost.predict_step_s(4, 64, 5000) == pytest.approx(1.8 * TRUE.predict_step_s(4, 64, 5000),
                                                            rel=0.05)
    for shape in _shapes(rng, 400):  # then a neighbour leaves: 0.9x
        cost.observe(shape, TRUE.predict_step_s(*shape) * 0.9)
    assert (cost.decode_scale, cost.prefill_scale) == pytest.approx((0.9, 0.9), rel=0.03)
    assert cost.steps == 800 and cost.measured_total_s > 0 and cost.predicted_total_s > 0


def test_the_prefill_side_is_corrected_apart_from_the_decode_side():
    # Calibrated right for decode steps, but a prefill token really costs twice the prior's.
    real = CostModel(TRUE.step_base_s, 2 * TRUE.prefill_token_s, TRUE.decode_token_s, "real",
                     TRUE.context_token_s)
    rng = random.Random(7)
    cost = StepCost(TRUE, alpha=0.05)
    for shape in _shapes(rng, 600):
        cost.observe(shape, real.predict_step_s(*shape) * math.exp(rng.gauss(0, 0.05)))
    assert cost.prefill_scale == pytest.approx(2.0, rel=0.05)
    assert cost.decode_scale == pytest.approx(1.0, abs=0.05)
    for shape in [(16, 0, 16 * 300), (1, 256, 300), (8, 64, 4000), (0, 512, 512)]:
        assert cost.predict_step_s(*shape) == pytest.approx(real.predict_step_s(*shape), rel=0.05)


def test_one_outlier_moves_the_correction_by_a_bounded_step():
    cost = StepCost(TRUE, alpha=0.05)
    cost.observe((1, 0, 100), 1000.0)  # a step 10^4 x its prediction (a swap storm)
    assert (cost.decode_scale, cost.prefill_scale) == (pytest.approx(4 ** 0.05), 1.0)
    assert cost.last_measured_s == 1000.0
    cost.observe((0, 0, 0), 1.0)  # an empty step tells nothing
    assert cost.steps == 1
    cost.observe((0, 256, 256), 1e-6)  # a prefill step far too fast: both sides, by their shares
    d, p = (0.01 + 256e-6) * 4 ** 0.05, 0.256
    shares = d / (d + p), p / (d + p)
    norm = shares[0] ** 2 + shares[1] ** 2
    assert cost.prefill_scale == pytest.approx(4 ** (-0.05 * shares[1] / norm))
    assert cost.decode_scale == pytest.approx(4 ** (0.05 - 0.05 * shares[0] / norm))
    # the prediction of that shape moved by 4^-alpha, as one scale would have moved it
    assert cost.predict_step_s(0, 256, 256) == pytest.approx((d + p) * 4 ** -0.05, rel=0.01)


@pytest.mark.parametrize("prefill", [1, 10, 20, 40, 100, 1000])
def test_one_outlier_mixed_step_moves_either_side_by_a_bounded_step(prefill):
    for measured in (1e3, 1e-6):
        cost = StepCost(TRUE, alpha=0.05)
        cost.observe((4, prefill, 400), measured)
        for scale in (cost.decode_scale, cost.prefill_scale):
            assert abs(math.log(scale)) <= 1.21 * 0.05 * math.log(4)


def test_the_correction_stays_within_its_clamp():
    cost = StepCost(TRUE, alpha=1.0)
    for _ in range(10):
        cost.observe((4, 0, 400), 1e6)
    assert cost.decode_scale == pytest.approx(16.0) and cost.prefill_scale == 1.0


def test_alpha_zero_keeps_the_prior():
    cost = StepCost(TRUE, alpha=0.0)
    cost.observe((1, 0, 100), 5.0)
    assert cost.decode_scale == cost.prefill_scale == 1.0
    assert cost.predict_plan_s(plan((1, 99))) == pytest.approx(TRUE.step_seconds(plan((1, 99))))
    assert cost.predict_plan_s(plan((64, 0), (1, 9))) == pytest.approx(TRUE.step_seconds(plan((64, 0), (1, 9))))
    with pytest.raises(ValueError, match="alpha"):
        StepCost(TRUE, alpha=1.5)


def test_time_outside_the_forward_is_a_decayed_mean_even_uncorrected():
    """Each busy gap moves the mean by ``OUTSIDE_WEIGHT`` of its distance (also with alpha 0:
    a measurement, not a correction); a negative gap (a clock that went back) is ignored."""
    from kvfleet.worker.step_cost.model import OUTSIDE_WEIGHT

    cost = StepCost(TRUE, alpha=0.0)
    assert cost.outside_s == 0.0
    cost.observe_outside(0.02)
    assert cost.outside_s == pytest.approx(OUTSIDE_WEIGHT * 0.02)
    for _ in range(400):
        cost.observe_outside(0.004)
    assert cost.outside_s == pytest.approx(0.004, rel=1e-6)
    cost.observe_outside(-1.0)
    assert cost.outside_s == pytest.approx(0.004, rel=1e-6)


class FakeExecutor:
    """Counts forwards; answers with zero logits at once (timing values are not asserted)."""

    def __init__(self, num_blocks: int = 200, block_size: int = 16) -> None:
        self.config = SimpleNamespace(max_position_embeddings=2048, vocab_size=1000)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.plans: list[StepPlan] = []

    def execute(self, p: StepPlan) -> torch.Tensor:
        for c in p.chunks:  # the plans stay inside the pool and the context
            assert max(c.block_table) < self.num_blocks
            assert c.num_computed_tokens + len(c.token_ids) <= self.config.max_position_embeddings
            assert len(c.block_table) * self.block_size >= c.num_computed_tokens + len(c.token_ids)
        self.plans.append(p)
        return torch.zeros(len(p.chunks), self.config.vocab_size)


KEY = CalibrationKey("ab" * 16, "cpu:x86_64:2", 1, "float32", 2)


def test_calibration_is_cached_per_key(tmp_path):
    ex = FakeExecutor()
    first = load_or_calibrate(ex, KEY, tmp_path)
    calls = len(ex.plans)
    assert calls >= 8 * 4  # >= 8 shapes, each timed four times (the first call warms it up)
    shapes = {plan_shape(p) for p in ex.plans}
    assert len({s.decode_rows for s in shapes}) >= 3 and len({s.prefill_tokens for s in shapes}) >= 3
    assert any(s.decode_rows and s.prefill_tokens for s in shapes)  # a mixed step too
    record = json.loads((tmp_path / f"{KEY.digest()}.json").read_text())
    assert record["key"]["tp"] == 1 and record["key"]["model_digest"] == KEY.model_digest
    assert len(record["samples"]) == len(shapes)
    assert load_or_calibrate(ex, KEY, tmp_path) == first
    assert len(ex.plans) == calls  # served from the cache: no forward ran
    for other in (CalibrationKey(KEY.model_digest, KEY.device, 2, KEY.dtype, KEY.threads),
                  CalibrationKey(KEY.model_digest, "cuda:H100", 1, KEY.dtype, KEY.threads),
                  CalibrationKey(KEY.model_digest, KEY.device, 1, "bfloat16", KEY.threads),
                  CalibrationKey("cd" * 16, KEY.device, 1, KEY.dtype, KEY.threads)):
        assert other.digest() != KEY.digest()
        load_or_calibrate(ex, other, tmp_path)
        assert len(ex.plans) > calls, other
        calls = len(ex.plans)
    assert len(list(tmp_path.glob("*.json"))) == 5


def test_a_corrupt_cache_file_only_costs_a_recalibration(tmp_path):
    (tmp_path / f"{KEY.digest()}.json").write_text("{not json")
    ex = FakeExecutor()
    load_or_calibrate(ex, KEY, tmp_path)
    assert ex.plans and json.loads((tmp_path / f"{KEY.digest()}.json").read_text())["key"]["dtype"] == "float32"
    ex2 = FakeExecutor()
    load_or_calibrate(ex2, KEY, None)  # no cache dir: calibrates, writes nothing
    assert ex2.plans


@pytest.mark.parametrize("num_blocks,block_size", [(150, 4), (40, 16), (2000, 16)])
def test_startup_plans_fit_small_pools(num_blocks, block_size):
    ex = FakeExecutor(num_blocks, block_size)
    for p in startup_plans(num_blocks, block_size, 2048, 1000):
        ex.execute(p)
    assert len(ex.plans) >= 4


class SlowExecutor(FakeExecutor):
    """A forward of 2 ms: long enough that a second caller arrives mid-calibration."""

    def execute(self, p: StepPlan) -> torch.Tensor:
        time.sleep(0.002)
        return super().execute(p)


def test_replicas_starting_together_calibrate_once(tmp_path):
    """Two replicas of one key on one host (threads here; separate processes hold the same
    flock): one measures, the other waits and reads its cache entry."""
    executors = [SlowExecutor(), SlowExecutor()]
    results: list[CostModel] = []
    threads = [threading.Thread(target=lambda ex=ex: results.append(load_or_calibrate(ex, KEY, tmp_path)))
               for ex in executors]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 2
    assert sorted(bool(ex.plans) for ex in executors) == [False, True]  # one timed forwards
    assert results[0].to_json() == results[1].to_json()


def test_host_lock_waits_a_bounded_time_then_goes_on_unlocked(tmp_path):
    lock = tmp_path / "sub" / "x.lock"
    with host_lock(lock, 1.0) as first:
        assert first and lock.exists()
        t0 = time.monotonic()
        with host_lock(lock, 0.3) as second:  # another holder: give up after 0.3 s
            assert not second and time.monotonic() - t0 >= 0.3
    with host_lock(lock, 0.0) as again:  # released when the first block ended
        assert again
    with host_lock(None, 1.0) as none:
        assert not none
    with pytest.raises(ValueError, match="wait_s"):
        with host_lock(lock, -1.0):
            pass


def test_calibration_is_cached_per_layer_group_layout(tmp_path, tiny_llama_dir):
    """A windowed layout's steps read other pages than the layout without groups: each
    layout has a key, a file and a calibration of its own; the key without groups is the
    one written before layouts were keyed (its old files still match). The replica keys
    its start-up calibration by its executor's layout."""
    from hashlib import sha256

    from kvfleet.allocator.layer_groups import LayerGroups
    from kvfleet.worker.replica.replica import ReplicaConfig, _step_cost

    gemma = LayerGroups.from_windows([7, 7, None, 7, 7, None]).layout_key
    mistral = LayerGroups.from_windows([7] * 6).layout_key
    keys = [CalibrationKey(KEY.model_digest, KEY.device, 1, KEY.dtype, KEY.threads, layout=lay)
            for lay in ("", gemma, mistral)]
    assert keys[0] == KEY
    old = {"model_digest": KEY.model_digest, "device": KEY.device, "tp": 1, "dtype": KEY.dtype,
           "threads": KEY.threads, "format": KEY.format}
    assert KEY.digest() == sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()[:32]
    assert len({k.digest() for k in keys}) == 3
    ex = FakeExecutor()
    for key in keys:
        calls = len(ex.plans)
        load_or_calibrate(ex, key, tmp_path)
        assert len(ex.plans) > calls, key  # not served from another layout's file
    assert json.loads((tmp_path / f"{keys[1].digest()}.json").read_text())["key"]["layout"] == gemma
    assert len(list(tmp_path.glob("*.json"))) == 3

    ex.layer_groups = LayerGroups.from_windows([7, 7, None, 7, 7, None])
    cfg = ReplicaConfig(replica_id="r", model_name="m", model_dir=str(tiny_llama_dir),
                        step_cost_dir=str(tmp_path))
    before = set(tmp_path.glob("*.json"))
    identity = SimpleNamespace(digest=lambda: bytes.fromhex(KEY.model_digest))
    _step_cost(cfg, ex, identity)
    ex.layer_groups = LayerGroups.single(6)
    _step_cost(cfg, ex, identity)
    new = {json.loads(p.read_text())["key"].get("layout", "")
           for p in set(tmp_path.glob("*.json")) - before}
    assert new == {gemma, ""}  # one calibration per layout of the replica's executor
