"""Where the store writes a batch (store/log.py): a small one on a fast disk on the loop
itself, a big one, one on a slow disk, or one while a checkpoint holds the log on the writer
thread; and when: at once if something waits for it, soon after if nothing does. Either way
the records are on disk and the waiters called back, in order."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from tandem.broker.model.broker import Broker
from tandem.broker.model.journal import Sequencer
from tandem.broker.store import log as store_log
from tandem.broker.store.log import Recovered, Store

Body = Callable[[Store, Broker, Sequencer], Awaitable[None]]


def with_store(tmp_path: Path, body: Body, recovered: list[Recovered] | None = None) -> None:
    """Run `body` on a store opened on `tmp_path`; what the start recovered goes to
    `recovered`."""

    async def run() -> None:
        seq = Sequencer()
        broker = Broker(seq)
        store = Store(tmp_path, fsync=False)
        seq.disk = store
        result = store.open(broker, seq, asyncio.get_running_loop())
        if recovered is not None:
            recovered.append(result)
        try:
            await body(store, broker, seq)
        finally:
            store.close()

    asyncio.run(run())


async def declared(broker: Broker, seq: Sequencer, name: str, size: int = 0) -> None:
    """Declare a durable queue (one durable record, `size` bytes of arguments more) and
    wait until it is on disk."""
    arguments = {"x-pad": "p" * size} if size else {}
    broker.vhost("/").declare_queue(name, durable=True, arguments=arguments)
    done = asyncio.get_running_loop().create_future()
    seq.when_done(lambda: done.set_result(None))
    await done


def on_disk(tmp_path: Path) -> list[str]:
    """The queues a store opened again on the same data dir recovers."""
    names: list[str] = []

    async def read(store: Store, broker: Broker, seq: Sequencer) -> None:
        names.extend(broker.vhost("/").queues)

    with_store(tmp_path, read)
    return sorted(names)


def test_a_small_batch_on_a_fast_disk_is_written_on_the_loop(tmp_path: Path) -> None:
    async def body(store: Store, broker: Broker, seq: Sequencer) -> None:
        broker.add_vhost("/")
        store.write_recent = 0.0  # a fast disk
        await declared(broker, seq, "a")  # opens a segment and the epochs: the thread
        assert store.written_here == 0
        await declared(broker, seq, "b")
        assert store.written_here == 1
        await declared(broker, seq, "c", size=store_log.INLINE_BYTES)  # too big for the loop
        assert store.written_here == 1
        store.write_recent = 1.0  # a slow disk: a second on the loop is too long
        await declared(broker, seq, "d")
        assert store.written_here == 1

    with_store(tmp_path, body)
    assert on_disk(tmp_path) == ["a", "b", "c", "d"]


def test_what_nothing_waits_for_goes_with_the_next_batch_or_soon_after(tmp_path: Path) -> None:
    """A record no confirm or reply waits for (a consumer's ack, say) is not written on its
    own: it goes with the next batch something waits for, or within LAZY_SECONDS."""

    async def body(store: Store, broker: Broker, seq: Sequencer) -> None:
        broker.add_vhost("/")
        await declared(broker, seq, "a")
        batches = store.synced_batches
        broker.vhost("/").declare_queue("b", durable=True)  # nothing waits for it
        await asyncio.sleep(0)  # the turn ends
        assert store.synced < store.handed and store.lazy is not None
        await declared(broker, seq, "c")  # a waiter: both go now, in one batch
        assert store.synced == store.handed and store.synced_batches == batches + 1
        assert store.lazy is None
        broker.vhost("/").declare_queue("d", durable=True)
        for _ in range(200):  # written soon, though nothing waits for it
            await asyncio.sleep(store_log.LAZY_SECONDS)
            if store.synced == store.handed:
                break
        assert store.synced == store.handed and store.synced_batches == batches + 2

    with_store(tmp_path, body)
    assert on_disk(tmp_path) == ["a", "b", "c", "d"]


def test_after_a_reset_only_what_is_written_again_is_on_disk(tmp_path: Path) -> None:
    """A backup that went past the point where it agrees with its primary starts its log over
    (a copy): its new records take offsets the old log had reached, and count as on disk
    only once they are written."""

    async def body(store: Store, broker: Broker, seq: Sequencer) -> None:
        broker.add_vhost("/")
        for name in ("a", "b", "c"):
            await declared(broker, seq, name)
        assert store.synced >= 3
        store.reset([(1, 1)])
        seq.reset(((1, 1),), 1)
        broker.vhost("/").declare_queue("d", durable=True)  # offset 2, not written yet
        assert seq.offset == 2 and store.synced < 2 and seq.dirty()
        done = asyncio.get_running_loop().create_future()
        seq.when_done(lambda: done.set_result(store.synced))
        assert await done >= 2

    with_store(tmp_path, body)


def writes_failing(times: int) -> tuple[list[OSError], Callable[[int, list[memoryview]], int]]:
    """A writev whose next `times` calls fail as on a full disk, and the failures left."""
    real = os.writev
    failures = [OSError(errno.ENOSPC, "No space left on device")] * times

    def full(fd: int, buffers: list[memoryview]) -> int:
        if failures:
            raise failures.pop()
        return real(fd, buffers)

    return failures, full


def test_after_a_failed_write_the_log_is_tried_again_on_the_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failing disk can take seconds to fail: it is never tried on the loop again until
    a write on the thread has worked."""
    failures, full = writes_failing(1)

    async def body(store: Store, broker: Broker, seq: Sequencer) -> None:
        broker.add_vhost("/")
        await declared(broker, seq, "a")
        store.write_recent = 0.0
        monkeypatch.setattr(os, "writev", full)
        await declared(broker, seq, "b")  # fails on the loop, then works on the thread
        assert not failures and store.written_here == 0 and store.write_error is None
        await declared(broker, seq, "c")  # the thread's write was fast: the loop again
        assert store.written_here == 1

    with_store(tmp_path, body)
    assert on_disk(tmp_path) == ["a", "b", "c"]


def test_an_epoch_written_before_a_failed_write_is_not_added_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The epochs file is appended before the batch's records: when the records then fail
    to go (a full disk), the retry writes the records, not the epoch a second time."""
    failures, full = writes_failing(2)

    async def body(store: Store, broker: Broker, seq: Sequencer) -> None:
        broker.add_vhost("/")
        await declared(broker, seq, "a")
        store.retry_seconds = 0.01
        monkeypatch.setattr(os, "writev", full)
        store.boundary(2, seq.offset + 1)
        await declared(broker, seq, "b")  # fails twice, then works
        assert not failures and store.write_error is None

    with_store(tmp_path, body)
    epochs = (tmp_path / "log" / "epochs").read_text().splitlines()
    assert [line for line in epochs if line.startswith("2 ")] == [epochs[-1]]
    assert on_disk(tmp_path) == ["a", "b"]


def test_a_batch_that_failed_for_a_log_reset_since_is_not_written_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed batch is tried again, unless the log it was for started over meanwhile (a
    backup took a full copy): its records would go into a segment of the old log, which
    the next start would replay before the new one's."""
    real = os.writev

    async def body(store: Store, broker: Broker, seq: Sequencer) -> None:
        loop = asyncio.get_running_loop()
        broker.add_vhost("/")
        await declared(broker, seq, "a")
        store.write_recent = 1.0  # on the thread: the reset comes before the failure's news
        reset = loop.create_future()

        def start_over() -> None:
            store.reset([(1, 1)])
            seq.reset(((1, 1),), 1)
            reset.set_result(None)

        def full(fd: int, buffers: list[memoryview]) -> int:
            monkeypatch.setattr(os, "writev", real)
            loop.call_soon_threadsafe(start_over)  # runs before the batch's callback
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "writev", full)
        broker.vhost("/").declare_queue("b", durable=True)  # its batch fails
        store.soon()
        await reset
        broker.vhost("/").declare_queue("c", durable=True)  # the new log's first record
        done = loop.create_future()
        seq.when_done(lambda: done.set_result(None))
        await done

    with_store(tmp_path, body)
    assert on_disk(tmp_path) == ["c"]


def test_a_batch_waits_for_the_thread_while_a_checkpoint_holds_the_log(tmp_path: Path) -> None:
    async def body(store: Store, broker: Broker, seq: Sequencer) -> None:
        broker.add_vhost("/")
        store.write_recent = 0.0
        store.lock.acquire()  # as a checkpoint being written does
        broker.vhost("/").declare_queue("a", durable=True)
        done = asyncio.get_running_loop().create_future()
        seq.when_done(lambda: done.set_result(None))
        for _ in range(3):  # the flush, then the write it hands on
            await asyncio.sleep(0)
        # The loop did not block on the lock: the batch waits on the writer thread.
        assert store.inflight is not None and not done.done()
        store.lock.release()
        await done
        assert store.written_here == 0

    with_store(tmp_path, body)
    assert on_disk(tmp_path) == ["a"]


def test_a_segment_is_allocated_ahead_and_its_zeros_are_no_tail(tmp_path: Path) -> None:
    """The segment being written has its space allocated ahead (`Store._allocate`), so a
    write leaves its size as it is. A start after a crash takes the zeros after the last
    record for the log's end, says nothing of a torn tail and cuts them off; a stop cuts
    them off itself."""
    crashed = tmp_path / "crashed"
    size = {}

    async def body(store: Store, broker: Broker, seq: Sequencer) -> None:
        broker.add_vhost("/")
        for name in ("a", "b"):
            await declared(broker, seq, name)
        (seg,) = store.dir.glob("*.seg")
        stat = seg.stat()
        assert stat.st_size == store.segment_bytes and stat.st_blocks * 512 >= stat.st_size
        size["written"] = store.sizes[int(seg.stem)]
        assert 0 < size["written"] < store.segment_bytes
        shutil.copytree(tmp_path / "log", crashed / "log")  # as kill -9 leaves it
        await declared(broker, seq, "c")

    with_store(tmp_path, body)
    (seg,) = (tmp_path / "log").glob("*.seg")
    assert size["written"] < seg.stat().st_size < store_log.Store(tmp_path).segment_bytes

    async def recover(store: Store, broker: Broker, seq: Sequencer) -> None:
        assert sorted(broker.vhost("/").queues) == ["a", "b"]
        (seg,) = store.dir.glob("*.seg")
        assert seg.stat().st_size == size["written"]  # cut off: no zeros before new records
        await declared(broker, seq, "d")

    recovered: list[Recovered] = []
    with_store(crashed, recover, recovered)
    assert recovered[0].truncated == [] and recovered[0].corrupt == []
    assert on_disk(crashed) == ["a", "b", "d"]
