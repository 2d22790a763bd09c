"""Priority classes and admission (python_backends/admission/), without Triton."""

import multiprocessing as mp
import os
import re
from pathlib import Path

import pytest

from contract.errors import InputError, Overloaded
from python_backends.admission.classes import (
    CACHED_ENTRIES,
    CLASSES,
    DIRECT_ENTRIES,
    check_request_class,
    class_named,
)
from python_backends.admission.controller import Admission
from python_backends.admission.inflight import SharedInflight, default_directory
from python_backends.admission.yielding import InflightReader, YieldTo, yield_from_config

ROOT = Path(__file__).resolve().parents[2]
REPO = ROOT / "model_repository"


def test_budgets_are_the_seed_articles_table():
    assert {c.name: c.budget_ms for c in CLASSES.values()} == {"interactive": 50, "default": 200, "bulk": 1000}


@pytest.mark.parametrize("bad", ["urgent", "", "Interactive", None, 1, "interactive\x00"])
def test_an_unknown_class_names_the_field_and_the_choices(bad):
    with pytest.raises(InputError) as err:
        class_named(bad)
    assert err.value.field == "priority_class"
    assert "interactive, default, bulk" in str(err.value)


def test_a_request_for_another_class_is_told_which_entry_serves_it():
    with pytest.raises(InputError) as err:
        check_request_class('{"priority_class": "interactive"}', CLASSES["default"])
    assert "text_embedding_cached_interactive" in str(err.value) and err.value.field == "priority_class"
    check_request_class('{"priority_class": "default"}', CLASSES["default"])  # its own class: fine
    check_request_class("{}", CLASSES["bulk"])
    check_request_class('{"routing_key": "a"}', CLASSES["bulk"])
    check_request_class(None, CLASSES["bulk"])
    with pytest.raises(InputError):
        check_request_class({"priority_class": 7}, CLASSES["bulk"])


def test_rows_are_limited_across_processes_and_an_empty_lane_always_admits(tmp_path):
    a = SharedInflight(tmp_path, "default", 100, max_batches=5)
    b = SharedInflight(tmp_path, "default", 100, max_batches=5, pid=os.getppid())  # another live process
    assert a.try_add(60) and b.try_add(40)
    assert a.total() == (100, 2)
    assert not a.try_add(1) and not b.try_add(1)  # full for both processes
    b.remove(40)
    assert a.try_add(40) and a.total() == (100, 2)
    a.remove(40), a.remove(60)
    assert a.total() == (0, 0)
    assert a.try_add(500), "a batch larger than the limit is admitted when the lane is empty"
    assert not b.try_add(1)


def test_batches_are_limited_so_an_instance_stays_free(tmp_path):
    a = SharedInflight(tmp_path, "bulk", 1000, max_batches=1)
    assert a.try_add(1) and not a.try_add(1)
    a.remove(1)
    assert a.try_add(1)


def _hold(directory, ready, done):
    pool = SharedInflight(Path(directory), "default", 10, max_batches=10)
    assert pool.try_add(10)
    ready.set()
    done.wait(10)
    os._exit(0)  # dies holding its rows: no remove, no close


def test_rows_of_a_process_that_died_are_not_counted(tmp_path):
    ctx = mp.get_context("fork")
    ready, done = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_hold, args=(str(tmp_path), ready, done))
    child.start()
    assert ready.wait(10)
    pool = SharedInflight(tmp_path, "default", 10, max_batches=10)
    assert pool.total() == (10, 1) and not pool.try_add(1)
    done.set()
    child.join(10)
    assert pool.total() == (0, 0) and pool.try_add(10)


def test_admission_refuses_with_overloaded_and_releases_after_the_call(tmp_path):
    adm = Admission(CLASSES["default"], SharedInflight(tmp_path, "default", 8, max_batches=1))
    with adm.rows(8):
        with pytest.raises(Overloaded, match="'default' is at capacity \\(8 rows"):
            with adm.rows(1):
                pass
    with adm.rows(3):  # released after the first block, also when its body raised
        pass
    with pytest.raises(RuntimeError), adm.rows(3):
        raise RuntimeError("BLS failed")
    assert adm.inflight.total() == (0, 0)
    assert (adm.admitted, adm.refused) == (14, 1)  # rows


def test_a_reused_pid_is_not_the_process_that_held_the_rows(tmp_path):
    """A cell names its process by pid and start time: after a restart the pid may be reused
    by another process, whose cell must not inherit the old rows."""
    import struct

    from python_backends.admission import inflight

    pool = SharedInflight(tmp_path, "default", 10)
    fd = os.open(tmp_path / "default.inflight", os.O_RDWR)
    # a cell left by "this pid" from an earlier boot of it (another start time), holding 10 rows
    os.pwrite(fd, struct.pack("<qqqq", os.getppid(), 1, 10, 1), inflight._CELL.size * 5)
    os.close(fd)
    assert pool.total() == (0, 0) and pool.try_add(10)


def test_the_directory_is_per_server(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_ADMISSION_DIR", raising=False)
    assert default_directory("server-1") != default_directory("server-2")
    monkeypatch.setenv("TRITON_ADMISSION_DIR", str(tmp_path))
    assert default_directory("server-1") == tmp_path / "server-1"


def _param(text, key):
    m = re.search(r'key:\s*"' + key + r'"\s*value:\s*\{\s*string_value:\s*"([^"]*)"', text)
    return m.group(1) if m else None


def _strip_comments(text):
    return "\n".join(line for line in text.splitlines() if line.strip() and not line.strip().startswith("#"))


@pytest.mark.parametrize("cls", ["interactive", "bulk"])
def test_class_entries_are_the_default_entry_but_for_class_lane_and_instances(cls):
    """The class entries run the default entry's code (a link to its model.py) with the same
    cache settings; only the class, its lane, its limits and the instance count differ."""
    default = (REPO / "text_embedding_cached" / "config.pbtxt").read_text()
    entry = REPO / CACHED_ENTRIES[cls]
    text = (entry / "config.pbtxt").read_text()
    assert (entry / "1" / "model.py").resolve() == (REPO / "text_embedding_cached" / "1" / "model.py").resolve()
    assert _param(text, "priority_class") == cls and _param(default, "priority_class") == "default"
    assert _param(text, "target_model") == DIRECT_ENTRIES[cls] == _param(text, "load_with")
    differ = {"priority_class", "admission_rows", "target_model", "load_with", "encoder_model", "process_nice"}
    keys = set(re.findall(r'key:\s*"([^"]+)"', default)) | set(re.findall(r'key:\s*"([^"]+)"', text))
    for key in keys - differ:
        assert _param(text, key) == _param(default, key), f"{CACHED_ENTRIES[cls]} parameter {key} differs"
    for line in ("max_batch_size: 64", 'backend: "python"', "max_queue_delay_microseconds: 0"):
        assert line in _strip_comments(text) and line in _strip_comments(default)
    count = int(re.search(r"count:\s*(\d+)", _strip_comments(text)).group(1))
    assert count >= 2, "one instance must stay free to answer hits and refuse at once"


def test_the_interactive_lane_is_the_ensemble_with_the_lane_encoder():
    default = _strip_comments((REPO / "text_embedding" / "config.pbtxt").read_text())
    lane = _strip_comments((REPO / "text_embedding_interactive" / "config.pbtxt").read_text())
    steps = re.findall(r'model_name:\s*"([^"]+)"', lane)
    assert steps == ["text_tokenizer", "text_encoder_interactive"]
    assert re.findall(r'model_name:\s*"([^"]+)"', default)[0] == "text_tokenizer"
    assert "text_encoder_interactive:" not in lane and _param(lane, "lane_of") == "text_embedding"
    assert re.search(
        r'lanes"\s*value:\s*\{\s*string_value:\s*"interactive:1"', (REPO / "text_encoder" / "config.pbtxt").read_text()
    )


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, s):
        self.now += s


def test_a_lower_class_waits_while_the_higher_class_has_rows_in_flight(tmp_path):
    interactive = SharedInflight(tmp_path, "interactive", 32)
    clock = _Clock()
    polls = []

    class Reader(InflightReader):
        def rows(self):
            rows = super().rows()
            polls.append(rows)
            if len(polls) == 4:  # the interactive request finishes after three looks
                interactive.remove(2)
            return rows

    yielder = YieldTo(Reader(tmp_path, "interactive"), max_wait_s=0.020, poll_s=0.001, clock=clock, sleep=clock.sleep)
    assert yielder.wait() == 0.0 and polls == [0]  # idle class: no wait, one look
    assert interactive.try_add(2)
    ran = []
    run = yielder.wrap(lambda feed: ran.append((feed, clock.now)) or "out")
    assert run("feed") == "out"
    assert ran == [("feed", pytest.approx(0.003))] and yielder.waits == 1
    assert polls[1:] == [2, 2, 2, 0]


def test_the_wait_is_bounded_so_the_lower_class_is_never_stopped(tmp_path):
    interactive = SharedInflight(tmp_path, "interactive", 32)
    assert interactive.try_add(1)  # never leaves
    clock = _Clock()
    yielder = YieldTo(InflightReader(tmp_path, "interactive"), max_wait_s=0.020, poll_s=0.001, clock=clock, sleep=clock.sleep)
    assert yielder.wait() == pytest.approx(0.020)
    assert yielder.wait() == pytest.approx(0.020) and yielder.waited_s == pytest.approx(0.040)


def test_rows_of_other_classes_and_of_dead_processes_do_not_make_it_wait(tmp_path):
    assert SharedInflight(tmp_path, "bulk", 16).try_add(4)
    ctx = mp.get_context("fork")
    ready, done = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_hold_class, args=(str(tmp_path), "interactive", ready, done))
    child.start()
    assert ready.wait(10)
    reader = InflightReader(tmp_path, "interactive")
    assert reader.rows() == 3
    done.set()
    child.join(10)
    assert reader.rows() == 0  # it died holding its rows


def _hold_class(directory, name, ready, done):
    pool = SharedInflight(Path(directory), name, 10)
    pool.try_add(3)
    ready.set()
    done.wait(10)
    os._exit(0)


class _Config:
    def __init__(self, **params):
        self.params = params

    def param(self, key, default=None):
        return self.params.get(key, default)

    def param_int(self, key, default, minimum=None):
        value = int(self.params.get(key, default))
        if minimum is not None and value < minimum:
            raise ValueError(f"{key} must be >= {minimum}")
        return value


def test_yield_settings_come_from_the_config(tmp_path):
    assert yield_from_config(_Config(), tmp_path) is None
    y = yield_from_config(_Config(yield_to_class="interactive", yield_max_ms="5"), tmp_path)
    assert y.max_wait_s == pytest.approx(0.005)
    with pytest.raises(InputError, match="yield_to_class"):
        yield_from_config(_Config(yield_to_class="urgent"), tmp_path)


def test_the_served_encoder_yields_to_interactive_and_its_lane_does_not():
    from export.lanes import Lane, render_config

    text = (ROOT / "model_repository/text_encoder/config.pbtxt").read_text()
    assert 'key: "yield_to_class" value: { string_value: "interactive" }' in text
    assert "yield_" not in render_config(text, Lane("text_encoder", "interactive", 1))
