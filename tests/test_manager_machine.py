"""KVCacheManager with its actors and real tensors against the plain prefix model (akv.testing).

The default run uses the machine's shipped settings (40 examples of up to 30
rules); ``-m slow`` runs 2,000. The hook tests run the machine the way an
embedder would: another storage dtype and their own K/V reads and writes, and
a runner whose one bad write the machine must catch.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from akv.config import MODEL_SHAPES, KVCacheConfig
from akv.testing import ManagerMachine, TestManagerMachine

__all__ = ["TestManagerMachine"]


def test_machine_is_exported_with_its_settings() -> None:
    assert TestManagerMachine is ManagerMachine.TestCase
    assert (TestManagerMachine.settings.max_examples, TestManagerMachine.settings.stateful_step_count) == (40, 30)
    assert TestManagerMachine.settings.deadline is None


@pytest.mark.slow
def test_manager_machine_large() -> None:
    run_state_machine_as_test(
        ManagerMachine,
        settings=settings(TestManagerMachine.settings, max_examples=2000, stateful_step_count=40),
    )


class Float16PerLayerMachine(ManagerMachine):
    """An embedder's variant: float16 K/V, written and read one layer at a time (``write`` / ``gather``)."""

    def make_config(self, **kw) -> KVCacheConfig:
        config = super().make_config(**kw)
        return dataclasses.replace(config, model=dataclasses.replace(MODEL_SHAPES["tiny"], dtype="float16"))

    def write_kv(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        values = values.to(torch.float16)
        for layer in range(values.shape[0]):
            self.kv.storage.write(layer, slots, values[layer, 0], values[layer, 1])

    def read_kv(self, block_ids: tuple[int, ...], num_tokens: int) -> torch.Tensor:
        table = torch.tensor(block_ids, dtype=torch.int32)
        layers = range(self.kv.storage.num_layers)
        return torch.stack([torch.stack(self.kv.storage.gather(layer, table, num_tokens)) for layer in layers])


def test_machine_runs_with_the_storage_hooks() -> None:
    seen = []

    class Recorded(Float16PerLayerMachine):
        def read_kv(self, block_ids, num_tokens):
            got = super().read_kv(block_ids, num_tokens)
            seen.append(got.dtype)
            return got

    run_state_machine_as_test(Recorded, settings=settings(TestManagerMachine.settings, max_examples=8))
    assert seen and set(seen) == {torch.float16}


def test_machine_catches_one_corrupted_write() -> None:
    class OneBadWrite(ManagerMachine):
        """The runner writes one element of the third token of each example off by 0.25."""

        def __init__(self) -> None:
            super().__init__()
            self.written = 0

        def write_kv(self, slots: torch.Tensor, values: torch.Tensor) -> None:
            values = values.clone()
            if self.written <= 2 < self.written + values.shape[2]:
                values[1, 1, 2 - self.written, 0, 3] += 0.25
            self.written += values.shape[2]
            super().write_kv(slots, values)

    quick = settings(TestManagerMachine.settings, max_examples=30, phases=[Phase.generate], database=None)
    with pytest.raises(AssertionError, match="K/V read back differs"):
        run_state_machine_as_test(OneBadWrite, settings=settings(quick, suppress_health_check=list(HealthCheck)))
