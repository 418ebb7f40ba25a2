"""The heartbeat fields a worker places by, as the controller's snapshot reads them."""

from __future__ import annotations

from types import SimpleNamespace

from lorafn.runtime.worker import WorkerSettings, placement_fields

MiB = 1 << 20


def test_a_worker_started_with_a_kv_budget_reports_the_grant_beside_its_cache() -> None:
    # the cache is whole KV blocks and comes out a little under the grant; the snapshot takes the larger
    runner = SimpleNamespace(memory_parts=lambda: (94 * MiB, 3 * MiB), device=None)
    engine = SimpleNamespace(lora_shape_key="q_proj:8", runner=runner)
    fields = placement_fields(WorkerSettings(gpu="g0", backbone="tiny", kv_budget_mib=96), engine)
    assert fields["kv_bytes"] == 94 * MiB and fields["kv_budget_bytes"] == 96 * MiB
    assert fields["shape"] == "q_proj:8" and fields["gpu"] == "g0"


def test_without_a_budget_no_grant_is_reported() -> None:
    engine = SimpleNamespace(lora_shape_key=None)
    assert "kv_budget_bytes" not in placement_fields(WorkerSettings(gpu="g0", backbone="tiny"), engine)
