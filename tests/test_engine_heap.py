"""Engine start-up freezes the heap it leaves (core/engine/heap.py): full collections then
skip the model, the graphs and the rest of start-up's objects."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from helpers import CPU, cpu_engine, standin_device

from graphrt.core.engine import SamplingParams
from graphrt.core.models import load_model


class _Cycle:
    def __init__(self):
        self.me = self  # only a collection frees it


@pytest.fixture(scope="module")
def loaded(llama_gqa_untied):
    return load_model(str(llama_gqa_untied.path), CPU, torch.float32)


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()  # what this test froze walks with the rest again


def _walked(obj) -> bool:
    """Does a collection walk ``obj``? (gc.get_objects lists every generation but the
    permanent one that gc.freeze fills.)"""
    return any(o is obj for o in gc.get_objects())


def test_start_up_collects_garbage_then_freezes_what_is_alive(loaded, unfrozen):
    alive = _Cycle()
    dead = weakref.ref(_Cycle())  # garbage already: a cycle nothing else reaches
    assert dead() is not None and _walked(alive)
    engine = cpu_engine(loaded)
    assert dead() is None  # collected before the freeze, not kept for ever
    assert not _walked(alive) and gc.get_freeze_count() > 0
    # What the engine allocates after start-up is collected as ever.
    later = weakref.ref(_Cycle())
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
    gc.collect()
    assert later() is None


def test_freeze_gc_false_leaves_the_collector_alone(loaded, unfrozen):
    alive = _Cycle()
    cpu_engine(loaded, freeze_gc=False)
    assert gc.get_freeze_count() == 0 and _walked(alive)


@pytest.mark.parametrize("runner", ["eager", pytest.param("graph", marks=pytest.mark.graphs)])
def test_an_engine_alive_at_anothers_freeze_is_still_freed_when_dropped(loaded, unfrozen, runner):
    """Freezing keeps nothing alive that reference counting frees: an engine (graphs, KV
    pool) frozen by a later engine's start-up goes as soon as its last reference does."""
    device = standin_device() if runner == "graph" else None
    first = cpu_engine(loaded, device=device, runner=runner, graph_buckets=(1, 2))
    first.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
    assert (first.stats.graph_steps > 0) == (runner == "graph")
    gone, pool = weakref.ref(first), weakref.ref(first.kv_pool)
    cpu_engine(loaded)  # freezes the first engine with everything else alive
    assert not _walked(first)
    del first
    assert gone() is None and pool() is None  # no collection needed
