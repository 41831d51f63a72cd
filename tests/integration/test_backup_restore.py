"""`cronoq-server backup` never harms the store it copies (its target is no file of the store or
of its leadership; its temporary file is its own; a full disk is blamed on the target), and a
restore hands out no task id the replaced store could have given (docs/operations.md)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from _helpers import Api
from conftest import ServerProcess  # type: ignore[import-not-found]
from pgserver import find_bin_dir
from preconditions import missing  # type: ignore[import-not-found]
from test_operations import cli_backup, list_all
from test_sharding_faults import fresh_database, pg_fetch

pytestmark = pytest.mark.timeout(180)
REFUSAL = "(a backup never replaces a file of a store or of its leadership, even with --force)"


def test_backup_never_replaces_a_file_the_store_or_its_leadership_uses(start_server: Any, tmp_path: Path) -> None:
    store = tmp_path / "c.db"
    config = {"store": {"path": str(store)}}
    srv = start_server(config)
    api = Api(srv.grpc_target)
    acknowledged = {api.submit(payload=b"x" * 100).id for _ in range(60)}
    wal, lock = f"{store}-wal", f"{store}.leader"
    (tmp_path / "sub").mkdir()
    os.symlink(wal, tmp_path / "link-to-wal")
    os.symlink(f"{store}-journal", tmp_path / "link-to-journal")  # dangling: there is no journal now
    os.symlink(tmp_path, tmp_path / "folder-link")
    os.link(lock, tmp_path / "hard-link-to-lock")
    what = {
        "store": f"the store {store}",
        "wal": f"the store's write-ahead log {wal}",
        "lock": f"the store's leadership lock {lock}",
    }
    refused = {
        wal: what["wal"],
        str(store): what["store"],
        f"{store}-shm": f"the store's shared-memory index {store}-shm",
        f"{store}-journal": f"the store's rollback journal {store}-journal",
        lock: what["lock"],
        f"{lock}.standby-x": f"a standby's file of the store's leadership {lock}.standby-x",
        str(tmp_path / "link-to-wal"): what["wal"],
        str(tmp_path / "link-to-journal"): f"the store's rollback journal {store}-journal",
        str(tmp_path / "sub" / ".." / "c.db-wal"): what["wal"],
        str(tmp_path / "folder-link" / "c.db.leader"): what["lock"],
        str(tmp_path / "hard-link-to-lock"): what["lock"],
    }
    inodes = {p: os.stat(p).st_ino for p in (store, wal, lock)}
    cases = [(wal, what["wal"], []), *((t, n, ["--force"]) for t, n in refused.items())]
    outcomes = backups_in_one_process(srv, [["--to", target, *force] for target, _, force in cases])
    assert outcomes == [[2, f"cronoq-server backup: --to {t}: is {named} {REFUSAL}\n"] for t, named, _ in cases]
    assert {p: os.stat(p).st_ino for p in (store, wal, lock)} == inodes
    assert sorted(p.name for p in tmp_path.iterdir() if "partial" in p.name) == []
    acknowledged |= {api.submit(payload=b"y" * 100).id for _ in range(60)}
    # The lock still excludes: a second server on the store stays a standby...
    second = start_server(config, name="second", wait_ready=False)
    second.wait_ready(leader=False)
    time.sleep(1.0)
    assert second.http("GET", "/readyz")[0] != 200
    # ...and takes over with every acknowledged task when the leader dies without a word.
    srv.kill()
    second.wait_ready(timeout=30)
    assert acknowledged <= set(list_all(Api(second.grpc_target)))
    assert second.stop() == 0


def backups_in_one_process(srv: Any, runs: list[list[str]]) -> list[list[Any]]:
    """`cronoq-server backup --config ... ARGS` for each ARGS, through the CLI's main in one process
    (one interpreter start, not one a run): [exit code, stderr] of each."""
    script = """import contextlib, io, json, sys
from cronoq_server.main import main
for args in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            main(["backup", "--config", sys.argv[2], *args])
        except SystemExit as exit:
            print(json.dumps([exit.code, err.getvalue()]))
"""
    cmd = [sys.executable, "-c", script, json.dumps(runs), str(srv.config_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    return [json.loads(line) for line in out.stdout.splitlines()]


def test_backup_refuses_another_shards_store(tmp_path: Path) -> None:
    sharded = {
        "store": {"path": str(tmp_path / "{shard}.db")},
        "pools": [{"name": "a"}, {"name": "b"}],
        "shards": [
            {"name": "cpu", "number": 1, "pools": ["a"], "endpoint": "http://127.0.0.1:1"},
            {"name": "gpu", "number": 2, "pools": ["b"], "endpoint": "http://127.0.0.1:2"},
        ],
    }
    shard = ServerProcess(tmp_path, sharded, shard="cpu", name="cpu").start()
    try:
        gpu = tmp_path / "gpu.db"
        gpu.write_bytes(b"gpu's store")
        out = cli_backup(shard, "--shard", "cpu", "--to", str(gpu), "--force")
        assert (out.returncode, out.stderr) == (2, f"cronoq-server backup: --to {gpu}: is the store {gpu} {REFUSAL}\n")
        assert gpu.read_bytes() == b"gpu's store"
    finally:
        assert shard.stop() == 0


def test_backup_temporary_file_is_its_own(tmp_path: Path) -> None:
    """A symlink planted where the temporary file used to be (.NAME.partial-PID) is not followed:
    the copy is a file of its own, mode 0600, and nothing lands where the symlink points."""
    store = tmp_path / "c.db"
    srv = ServerProcess(tmp_path, {"store": {"path": str(store)}}).start()
    Api(srv.grpc_target).submit(payload=b"x")
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o1777)
    elsewhere = tmp_path / "attacker"
    elsewhere.mkdir(mode=0o777)
    target = shared / "copy.db"
    plant = (
        "import os, sys; from cronoq_server.main import main; "
        f"os.symlink({str(elsewhere / 'stolen.db')!r}, {str(shared)!r} + f'/.copy.db.partial-{{os.getpid()}}'); "
        "main(sys.argv[1:])"
    )
    cmd = [sys.executable, "-c", plant, "backup", "--config", str(srv.config_path), "--to", str(target)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert srv.stop() == 0
    assert out.returncode == 0, out.stderr
    assert list(elsewhere.iterdir()) == []
    mode = os.lstat(target).st_mode
    assert stat.S_ISREG(mode) and stat.S_IMODE(mode) == 0o600
    with contextlib.closing(sqlite3.connect(f"file:{target}?mode=ro", uri=True)) as db:
        assert db.execute("SELECT count(*) FROM tasks").fetchone()[0] == 1


@pytest.fixture
def small_disk(tmp_path: Path) -> Any:
    """A 64 KiB tmpfs (mounting needs root)."""
    if os.geteuid() != 0:
        missing("mounting a small tmpfs needs root")
    folder = tmp_path / "small"
    folder.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)], check=True, timeout=30)
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True, timeout=30)


def test_backup_on_a_full_disk_names_the_target(small_disk: Path, tmp_path: Path) -> None:
    store = tmp_path / "c.db"
    srv = ServerProcess(tmp_path, {"store": {"path": str(store)}}).start()
    api = Api(srv.grpc_target)
    for _ in range(40):
        api.submit(payload=os.urandom(4000))
    target = small_disk / "copy.db"
    out = cli_backup(srv, "--to", str(target))
    assert srv.stop() == 0
    assert (out.returncode, out.stderr) == (2, f"cronoq-server backup: --to {target}: database or disk is full\n")
    assert list(small_disk.iterdir()) == []


def cli_restore(srv: Any, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "cronoq_server.main", "restore", "--config", str(srv.config_path), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("how", ["restore-command", "copied-by-hand", "postgres"])
def test_restore_hands_out_no_task_id_the_replaced_store_gave(
    start_server: Any, tmp_path: Path, request: Any, how: str
) -> None:
    """Backup at 40 tasks, 60 more given by the store after it; after the documented restore the
    next task's id is above every id the replaced store gave."""
    if how == "postgres":
        pg = request.getfixturevalue("postgres")
        bin_dir = find_bin_dir()
        url, restored_url = fresh_database(pg), fresh_database(pg)
        store: dict[str, Any] = {"kind": "postgres", "url": url}
    else:
        path = tmp_path / "c.db"
        store = {"path": str(path)}
    srv = start_server({"store": store})
    api = Api(srv.grpc_target)
    before = [api.submit(payload=b"x").id for _ in range(40)]
    dump = tmp_path / "c.dump"
    backup = tmp_path / "backup" / "c.db"
    backup.parent.mkdir()
    if how == "postgres":
        args = ["--schema=cronoq", "--format=custom", f"--file={dump}", url]
        subprocess.run([str(bin_dir / "pg_dump"), *args], check=True, capture_output=True, timeout=60)
    else:
        out = cli_backup(srv, "--to", str(backup))
        assert out.returncode == 0, out.stderr
    after = [api.submit(payload=b"y").id for _ in range(60)]
    if how == "restore-command":
        refused = cli_restore(srv, "--from", str(backup))
        assert (refused.returncode, refused.stderr) == (
            2,
            f"cronoq-server restore: store {path}: a server of the shard holds its leadership lock "
            f"{path}.leader (stop every server of the shard first)\n",
        )
    assert srv.stop() == 0

    if how == "restore-command":
        out = cli_restore(srv, "--from", str(backup))
        assert out.returncode == 0, out.stderr
        aside = next(p for p in tmp_path.iterdir() if p.name.startswith("c.db.replaced-"))
        assert out.stdout.startswith(f"restored store {path} from {backup}: 40 tasks; the replaced store is {aside}")
        with contextlib.closing(sqlite3.connect(f"file:{aside}?mode=ro", uri=True)) as db:
            assert db.execute("SELECT count(*) FROM tasks").fetchone()[0] == 100
    elif how == "copied-by-hand":
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.rename(f"{path}{suffix}", f"{path}.old{suffix}")
        shutil.copy(backup, path)
    else:
        # The SQL of docs/operations.md, with the time pg_restore --list gives for the dump.
        listing = subprocess.run(
            [str(bin_dir / "pg_restore"), "--list", str(dump)], check=True, capture_output=True, text=True
        ).stdout
        created = next(line for line in listing.splitlines() if "Archive created at" in line).split(" at ", 1)[1]
        restore = ["--no-owner", "--exit-on-error", f"--dbname={restored_url}", str(dump)]
        subprocess.run([str(bin_dir / "pg_restore"), *restore], check=True, capture_output=True, timeout=60)
        pg_fetch(
            restored_url,
            "SELECT setval('cronoq.tasks_seq_seq', last_value + 1000000 * (1 + extract(epoch FROM now() - "
            f"'{created.strip()}'::timestamptz)::bigint)) FROM cronoq.tasks_seq_seq",
        )
        store = {"kind": "postgres", "url": restored_url}

    restored = start_server({"store": store}, name="restored")
    api = Api(restored.grpc_target)
    assert sorted(list_all(api)) == before
    new = api.submit(payload=b"z", key="after-restore").id
    assert new > max(after)
    assert restored.stop() == 0
    if how != "postgres":
        # The server took the store as restored once: a restart hands out the next id, no jump.
        again = start_server({"store": store}, name="again")
        assert Api(again.grpc_target).submit(payload=b"z").id == new + 1
        assert again.stop() == 0


def test_restore_refuses_what_is_not_a_backup(tmp_path: Path) -> None:
    path = tmp_path / "c.db"
    srv = ServerProcess(tmp_path, {"store": {"path": str(path)}}).start()
    Api(srv.grpc_target).submit(payload=b"x")
    assert srv.stop() == 0
    copy = tmp_path / "plain-copy.db"
    shutil.copy(path, copy)
    for source, why in [
        (copy, "not a cronoq-server backup (its meta has no backup_taken_at)"),
        (tmp_path / "missing.db", "no such file"),
        (path, f"is the store {path}"),
    ]:
        out = cli_restore(srv, "--from", str(source))
        assert out.returncode == 2
        assert out.stderr.startswith(f"cronoq-server restore: --from {source}: {why}"), out.stderr
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        assert db.execute("SELECT count(*) FROM tasks").fetchone()[0] == 1


def test_restore_refuses_while_a_standby_waits(tmp_path: Path) -> None:
    """A standby holds the store open: replacing the file under it would lose what it writes as leader."""
    path = tmp_path / "c.db"
    srv = ServerProcess(tmp_path, {"store": {"path": str(path)}}).start()
    backup = tmp_path / "backup.db"
    assert cli_backup(srv, "--to", str(backup)).returncode == 0
    assert srv.stop() == 0
    waiting = threading.Event()

    def say_standby() -> None:  # as a waiting standby does, every second
        while True:
            (tmp_path / "c.db.leader.standby-test").write_text("127.0.0.1:1")
            if waiting.wait(0.5):
                return

    saying = threading.Thread(target=say_standby)
    saying.start()
    try:
        out = cli_restore(srv, "--from", str(backup))
    finally:
        waiting.set()
        saying.join()
    assert (out.returncode, out.stderr) == (
        2,
        f"cronoq-server restore: store {path}: standby 127.0.0.1:1 is waiting for its leadership "
        "(stop every server of the shard first)\n",
    )
