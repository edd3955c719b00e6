"""The records file's writer thread: frames land in order, a commit waits for them, and a
failed write is raised (with how many went in before it), never dropped."""

from __future__ import annotations

import os
import threading

import pytest

from commcheck.collector.file_writer import FileWriter, WriteFailed


def test_frames_are_in_the_file_in_order_once_flushed(tmp_path):
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    w = FileWriter(fd)
    parts = [[i.to_bytes(4, "little"), bytes([i % 256]) * (i * 997 % 70_000)]
             for i in range(300)]  # more than the queue holds: the caller waits
    for p in parts:
        w.write(p)
    w.flush()
    assert path.read_bytes() == b"".join(b for p in parts for b in p)
    w.close()
    os.close(fd)


def test_a_failed_write_is_raised_with_what_went_in_before_it(tmp_path):
    before = set(threading.enumerate())
    r, wfd = os.pipe()
    os.set_blocking(wfd, False)
    w = FileWriter(wfd)
    w.write([b"x" * 10])
    w.flush()
    os.close(r)  # the reader is gone: the next write fails (EPIPE)
    w.write([b"y" * 10])
    w.write([b"z" * 10])
    with pytest.raises(WriteFailed) as e:
        w.flush()
    assert e.value.written == 0
    with pytest.raises(OSError):  # for good: nothing is written after a failure
        w.write([b"w"])
    with pytest.raises(WriteFailed):
        w.flush()
    with pytest.raises(WriteFailed):  # closing says so too, and still ends the thread
        w.close()
    assert not [t for t in threading.enumerate() if t.name == "commcheck-records-file"
                and t not in before]
    os.close(wfd)
