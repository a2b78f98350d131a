"""`BatchStore`: the Batch API's durable state, an SQLite database (WAL) and files on disk.

Owns what must survive the server: uploaded files (their bytes under `files/`, their
records in the `files` table; one past its `expires_at` is gone at once for every
reader, and swept from disk later), batches (`batches`: status, timestamps, errors, the
tenant that owns them), each batch's checked input lines (`lines`), and each line's
outcome (`outcomes`, keyed by batch and line: a line is answered at most once, and a line
counts as done only once its outcome is committed). Every query is scoped by tenant: a
tenant never sees, reads or cancels another's files and batches (another's id is the same
404 as an unknown one). Files are written to a temporary name, fsynced, then renamed,
before the row that names them commits; output files are named after their batch, so
finalizing again after a crash rewrites the same file. Outcomes commit with
synchronous=NORMAL (durable when the process dies; after a power loss the last ones may be
rolled back, and those lines simply run again), state changes with FULL. A lock file
keeps a second server off the same directory. Thread-safe (one connection behind a lock:
the routes and the runner call it from worker threads); it runs no line and knows no
HTTP.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import sqlite3
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator

from treadle.batch.lines import InputLine, LineError, parse_input, unanswered_line

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, expires_at INTEGER);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, models TEXT, endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL, status TEXT NOT NULL,
    created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL, in_progress_at INTEGER,
    finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER, expired_at INTEGER,
    cancelling_at INTEGER, cancelled_at INTEGER, output_file_id TEXT, error_file_id TEXT,
    errors TEXT, metadata TEXT, model TEXT, total INTEGER NOT NULL DEFAULT 0,
    output_expires_s INTEGER);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, line_no INTEGER NOT NULL, custom_id TEXT NOT NULL,
    body TEXT NOT NULL, PRIMARY KEY (batch_id, line_no));
CREATE TABLE IF NOT EXISTS outcomes (
    batch_id TEXT NOT NULL, line_no INTEGER NOT NULL, status_code INTEGER NOT NULL,
    result TEXT NOT NULL, PRIMARY KEY (batch_id, line_no));
"""

OPEN_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")
"""A batch in one of these has not reached its end; the runner drives each."""
_TIMESTAMPS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
               "cancelling_at", "cancelled_at")
_FINAL_STAMP = {"completed": "completed_at", "failed": "failed_at", "expired": "expired_at",
                "cancelled": "cancelled_at"}
_UNANSWERED_CODE = {"expired": "batch_expired", "cancelled": "batch_cancelled"}
_LIVE = "(expires_at IS NULL OR expires_at > ?)"
"""A file not yet past its expiry (the argument: now); expired ones are swept later."""


class BatchRequestError(ValueError):
    """A request the store refuses: HTTP status, message naming the field, the field."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class StateDirInUse(RuntimeError):
    """Another server holds the state directory's lock."""


def _now() -> int:
    return int(time.time())


def _fsync_write(path: Path, chunks: Iterator[bytes]) -> int:
    """Write chunks to `path` durably (temporary name, fsync, rename); bytes written."""
    tmp = path.with_name(path.name + ".tmp")
    size = 0
    with open(tmp, "wb") as out:
        for chunk in chunks:
            out.write(chunk)
            size += len(chunk)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
    return size


class BatchStore:
    """Files, batches and line outcomes under one state directory."""

    def __init__(self, state_dir: str | Path) -> None:
        self.root = Path(state_dir).expanduser()
        self.files_dir = self.root / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self._lock_file = open(self.root / "lock", "a+")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise StateDirInUse(f"the batch state directory {self.root} is in use by another "
                                "server (give this one its own --state-dir)") from None
        self.db_path = self.root / "batch.sqlite3"
        self._db = sqlite3.connect(self.db_path, isolation_level=None, check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA busy_timeout=30000")
        self._db.executescript(SCHEMA)
        self._mutex = threading.RLock()
        for leftover in self.files_dir.glob("*.tmp"):  # a write the last process never ended
            leftover.unlink()

    def close(self) -> None:
        with self._mutex:
            self._db.close()
            self._lock_file.close()

    @contextmanager
    def _transaction(self, durable: bool = True):
        with self._mutex:
            self._db.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _query(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._mutex:
            return self._db.execute(sql, args).fetchall()

    # ----- files --------------------------------------------------------------------------

    def add_file(self, tenant: str, filename: str, purpose: str, source: BinaryIO,
                 max_bytes: int, max_lines: int, expires_s: int | None = None) -> dict:
        """Store an uploaded file (413 past max_bytes, 400 past max_lines lines), gone
        `expires_s` seconds after its creation when given."""
        file_id = f"file-{secrets.token_hex(12)}"
        path = self.files_dir / file_id
        counted = {"lines": 0, "last": b"\n"}

        def chunks():
            size = 0
            while chunk := source.read(1 << 20):
                size += len(chunk)
                if size > max_bytes:
                    raise BatchRequestError(413, f"file: larger than {max_bytes} bytes "
                                            "(batch_max_file_bytes)", "file")
                counted["lines"] += chunk.count(b"\n")
                counted["last"] = chunk[-1:]
                if counted["lines"] > max_lines:
                    raise BatchRequestError(400, f"file: more than {max_lines} lines "
                                            "(batch_max_lines)", "file")
                yield chunk

        try:
            size = _fsync_write(path, chunks())
        except BaseException:
            path.with_name(path.name + ".tmp").unlink(missing_ok=True)
            raise
        now = _now()
        record = (file_id, tenant, filename, purpose, size, now,
                  None if expires_s is None else now + expires_s)
        with self._transaction() as db:
            db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?)", record)
        return self.get_file(tenant, file_id)

    def get_file(self, tenant: str, file_id: str) -> dict | None:
        rows = self._query(f"SELECT * FROM files WHERE id = ? AND tenant = ? AND {_LIVE}",
                           (file_id, tenant, _now()))
        return _file_object(rows[0]) if rows else None

    def file_path(self, tenant: str, file_id: str) -> Path | None:
        """Where a tenant's file's bytes are (None: no such file of this tenant)."""
        return self.files_dir / file_id if self.get_file(tenant, file_id) else None

    def list_files(self, tenant: str, purpose: str | None, after: str | None, limit: int,
                   order: str) -> tuple[list[dict], bool]:
        """A page of the tenant's files in creation order (`order` asc or desc), after the
        file `after`; (files, has_more). 404 when `after` is not one of its files."""
        where, args = f"tenant = ? AND {_LIVE}", [tenant, _now()]
        if purpose is not None:
            where, args = where + " AND purpose = ?", args + [purpose]
        rows = self._page("files", where, args, after, limit, order, "file")
        return [_file_object(r) for r in rows[:limit]], len(rows) > limit

    def delete_file(self, tenant: str, file_id: str) -> bool:
        with self._transaction() as db:
            deleted = db.execute(f"DELETE FROM files WHERE id = ? AND tenant = ? AND {_LIVE}",
                                 (file_id, tenant, _now())).rowcount
        if deleted:
            (self.files_dir / file_id).unlink(missing_ok=True)
        return bool(deleted)

    def sweep_expired(self) -> int:
        """Delete the files past their expiry (already invisible); how many."""
        with self._transaction() as db:
            gone = [r[0] for r in db.execute("SELECT id FROM files WHERE expires_at <= ?",
                                             (_now(),))]
            db.executemany("DELETE FROM files WHERE id = ?", [(g,) for g in gone])
        for file_id in gone:
            (self.files_dir / file_id).unlink(missing_ok=True)
        return len(gone)

    def _page(self, table: str, where: str, args: list, after: str | None, limit: int,
              order: str, what: str) -> list[sqlite3.Row]:
        """Up to limit + 1 rows (the extra one says there are more) by rowid."""
        direction, compare = ("DESC", "<") if order == "desc" else ("ASC", ">")
        if after is not None:
            found = self._query(f"SELECT rowid FROM {table} WHERE id = ? AND {where}",
                                (after, *args))
            if not found:
                raise BatchRequestError(404, f"after: no {what} {after!r}", "after")
            where, args = f"{where} AND rowid {compare} ?", [*args, found[0][0]]
        return self._query(f"SELECT * FROM {table} WHERE {where} ORDER BY rowid {direction} "
                           "LIMIT ?", (*args, limit + 1))

    # ----- batches --------------------------------------------------------------------------

    def create_batch(self, tenant: str, models: list[str] | None, input_file_id: str,
                     endpoint: str, window: str, window_s: int, metadata: dict | None,
                     max_open: int, output_expires_s: int | None = None) -> dict:
        """A new batch, `validating` (404 for another tenant's or an unknown file, 400 for a
        file of another purpose, 429 past the tenant's open batches); its output files
        expire `output_expires_s` after they are made, when given."""
        batch_id = f"batch_{secrets.token_hex(12)}"
        with self._transaction() as db:
            found = db.execute(f"SELECT purpose FROM files WHERE id = ? AND tenant = ? AND "
                               f"{_LIVE}", (input_file_id, tenant, _now())).fetchall()
            if not found:
                raise BatchRequestError(404, f"input_file_id: no file {input_file_id!r}",
                                        "input_file_id")
            if found[0][0] != "batch":
                raise BatchRequestError(400, f"input_file_id: the file's purpose is "
                                        f"{found[0][0]!r}, not 'batch'", "input_file_id")
            marks = ", ".join("?" * len(OPEN_STATUSES))
            (num_open,) = db.execute(f"SELECT count(*) FROM batches WHERE tenant = ? AND "
                                     f"status IN ({marks})", (tenant, *OPEN_STATUSES)).fetchone()
            if num_open >= max_open:
                raise BatchRequestError(429, f"this tenant has {num_open} unfinished batches "
                                        f"(batch_max_open_per_tenant={max_open}); retry when "
                                        "one has finished")
            now = _now()
            db.execute("INSERT INTO batches (id, tenant, models, endpoint, input_file_id, "
                       "completion_window, status, created_at, expires_at, metadata, "
                       "output_expires_s) VALUES (?, ?, ?, ?, ?, ?, 'validating', ?, ?, ?, ?)",
                       (batch_id, tenant, None if models is None else json.dumps(sorted(models)),
                        endpoint, input_file_id, window, now, now + window_s,
                        None if metadata is None else json.dumps(metadata), output_expires_s))
        return self.get_batch(tenant, batch_id)

    def _batch_row(self, batch_id: str) -> sqlite3.Row | None:
        rows = self._query("SELECT * FROM batches WHERE id = ?", (batch_id,))
        return rows[0] if rows else None

    def get_batch(self, tenant: str, batch_id: str) -> dict | None:
        row = self._batch_row(batch_id)
        if row is None or row["tenant"] != tenant:
            return None
        return self._batch_object(row)

    def list_batches(self, tenant: str, after: str | None, limit: int) -> tuple[list[dict], bool]:
        """A page of the tenant's batches, newest first; (batches, has_more)."""
        rows = self._page("batches", "tenant = ?", [tenant], after, limit, "desc", "batch")
        return [self._batch_object(r) for r in rows[:limit]], len(rows) > limit

    def request_counts(self, batch_id: str) -> dict:
        (answered, ok), = self._query(
            "SELECT count(*), coalesce(sum(status_code BETWEEN 200 AND 299), 0) FROM outcomes "
            "WHERE batch_id = ?", (batch_id,))
        total = self._query("SELECT total FROM batches WHERE id = ?", (batch_id,))[0][0]
        return {"total": total, "completed": ok, "failed": answered - ok}

    def _batch_object(self, row: sqlite3.Row) -> dict:
        """The batch as OpenAI's API shows it."""
        errors = json.loads(row["errors"]) if row["errors"] else None
        body = {"id": row["id"], "object": "batch", "endpoint": row["endpoint"],
                "errors": None if errors is None else {"object": "list", "data": errors},
                "input_file_id": row["input_file_id"],
                "completion_window": row["completion_window"], "status": row["status"],
                "output_file_id": row["output_file_id"], "error_file_id": row["error_file_id"],
                "created_at": row["created_at"], "expires_at": row["expires_at"],
                **{stamp: row[stamp] for stamp in _TIMESTAMPS},
                "request_counts": self.request_counts(row["id"]),
                "metadata": json.loads(row["metadata"]) if row["metadata"] else None,
                "model": row["model"]}
        return body

    def cancel_batch(self, tenant: str, batch_id: str) -> dict | None:
        """Ask a batch to stop (`cancelling`; the runner ends it): None for no batch of
        this tenant, 409 for one that has already ended."""
        with self._transaction() as db:
            row = db.execute("SELECT tenant, status FROM batches WHERE id = ?",
                             (batch_id,)).fetchone()
            if row is None or row["tenant"] != tenant:
                return None
            if row["status"] in ("validating", "in_progress"):
                db.execute("UPDATE batches SET status = 'cancelling', cancelling_at = ? "
                           "WHERE id = ?", (_now(), batch_id))
            elif row["status"] != "cancelling":
                raise BatchRequestError(409, f"batch {batch_id!r} is {row['status']}: only a "
                                        "validating or in-progress batch can be cancelled")
        return self.get_batch(tenant, batch_id)

    # ----- what the runner asks -------------------------------------------------------------

    def open_batches(self) -> list[dict]:
        """Every unfinished batch (any tenant), oldest first: id, tenant, models, endpoint,
        status, expires_at."""
        marks = ", ".join("?" * len(OPEN_STATUSES))
        rows = self._query(f"SELECT id, tenant, models, endpoint, status, expires_at FROM "
                           f"batches WHERE status IN ({marks}) ORDER BY rowid", OPEN_STATUSES)
        return [{**dict(r), "models": json.loads(r["models"]) if r["models"] else None}
                for r in rows]

    def validate(self, batch_id: str, max_lines: int) -> str:
        """Check the input file's lines: `in_progress` with its lines stored, or `failed`
        with the errors (each naming its line and field). Idempotent."""
        row = self._batch_row(batch_id)
        if row is None or row["status"] != "validating":
            return row["status"] if row is not None else "failed"
        path = self.file_path(row["tenant"], row["input_file_id"])
        if path is None or not path.exists():
            return self._fail(batch_id, [LineError(
                "invalid_request", f"input_file_id: the file {row['input_file_id']!r} was "
                "deleted before the batch was validated", "input_file_id")])
        with open(path, "rb") as lines_in:
            lines, errors = parse_input(lines_in, (row["endpoint"],), max_lines)
        if errors:
            return self._fail(batch_id, errors)
        model = _model_of(lines[0])
        with self._transaction() as db:
            status = db.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if status[0] != "validating":  # cancelled meanwhile: nothing to store
                return status[0]
            db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,))
            db.executemany("INSERT INTO lines VALUES (?, ?, ?, ?)",
                           [(batch_id, x.line_no, x.custom_id, x.body) for x in lines])
            db.execute("UPDATE batches SET status = 'in_progress', in_progress_at = ?, "
                       "total = ?, model = ? WHERE id = ?", (_now(), len(lines), model, batch_id))
        return "in_progress"

    def _fail(self, batch_id: str, errors: list[LineError]) -> str:
        with self._transaction() as db:
            db.execute("UPDATE batches SET status = 'failed', failed_at = ?, errors = ? "
                       "WHERE id = ? AND status = 'validating'",
                       (_now(), json.dumps([e.as_dict() for e in errors]), batch_id))
        return "failed"

    def pending_lines(self, batch_id: str) -> list[int]:
        """Line numbers of the batch with no outcome yet, in file order."""
        rows = self._query("SELECT line_no FROM lines WHERE batch_id = ? AND line_no NOT IN "
                           "(SELECT line_no FROM outcomes WHERE batch_id = ?) ORDER BY line_no",
                           (batch_id, batch_id))
        return [r[0] for r in rows]

    def line(self, batch_id: str, line_no: int) -> InputLine:
        row = self._query("SELECT custom_id, endpoint, body FROM lines JOIN batches ON "
                          "batches.id = batch_id WHERE batch_id = ? AND line_no = ?",
                          (batch_id, line_no))[0]
        return InputLine(line_no, row["custom_id"], row["endpoint"], row["body"])

    def record_outcome(self, batch_id: str, line_no: int, status_code: int,
                       result: dict) -> bool:
        """Commit a line's answer (its output-file line); False if it had one already."""
        with self._transaction(durable=False) as db:
            cursor = db.execute("INSERT OR IGNORE INTO outcomes VALUES (?, ?, ?, ?)",
                                (batch_id, line_no, status_code,
                                 json.dumps(result)))
        return cursor.rowcount == 1

    def mark_finalizing(self, batch_id: str) -> None:
        with self._transaction() as db:
            db.execute("UPDATE batches SET status = 'finalizing', finalizing_at = ? WHERE id = ? "
                       "AND status = 'in_progress'", (_now(), batch_id))

    def finalize(self, batch_id: str, final_status: str) -> None:
        """Write the output and error files, then end the batch with `final_status`
        (completed, expired or cancelled). Lines the batch never answered go to the error
        file as batch_expired / batch_cancelled. Safe to repeat after a crash."""
        row = self._batch_row(batch_id)
        if row is None or row["status"] not in OPEN_STATUSES:
            return
        stem = batch_id.removeprefix("batch_")
        written = {}
        for kind, ok in (("output", True), ("error", False)):
            file_id = f"file-{stem}-{kind}"
            size = _fsync_write(self.files_dir / file_id,
                                self._result_lines(batch_id, ok, final_status))
            written[kind] = (file_id, size) if size else None
            if not size:
                (self.files_dir / file_id).unlink(missing_ok=True)
        now, lifetime = _now(), row["output_expires_s"]
        with self._transaction() as db:
            for kind, entry in written.items():
                if entry is not None:
                    db.execute("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?, ?, ?)",
                               (entry[0], row["tenant"], f"{batch_id}_{kind}.jsonl",
                                "batch_output", entry[1], now,
                                None if lifetime is None else now + lifetime))
            stamp = _FINAL_STAMP[final_status]
            db.execute(f"UPDATE batches SET status = ?, {stamp} = ?, output_file_id = ?, "
                       "error_file_id = ? WHERE id = ?",
                       (final_status, _now(), written["output"] and written["output"][0],
                        written["error"] and written["error"][0], batch_id))

    def _result_lines(self, batch_id: str, ok: bool, final_status: str) -> Iterator[bytes]:
        """The output file's lines (ok) or the error file's, in input order."""
        test = "BETWEEN 200 AND 299" if ok else "NOT BETWEEN 200 AND 299"
        rows = self._query(f"SELECT result FROM outcomes WHERE batch_id = ? AND status_code "
                           f"{test} ORDER BY line_no", (batch_id,))
        for r in rows:
            yield r[0].encode("utf-8") + b"\n"
        code = _UNANSWERED_CODE.get(final_status)
        if not ok and code is not None:
            for custom_id in self._query(
                    "SELECT custom_id FROM lines WHERE batch_id = ? AND line_no NOT IN (SELECT "
                    "line_no FROM outcomes WHERE batch_id = ?) ORDER BY line_no",
                    (batch_id, batch_id)):
                yield (json.dumps(unanswered_line(custom_id[0], code))
                       + "\n").encode("utf-8")


def _model_of(line: InputLine) -> str | None:
    model = json.loads(line.body).get("model")
    return model if isinstance(model, str) else None


def _file_object(row: sqlite3.Row) -> dict:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"],
            "created_at": row["created_at"], "filename": row["filename"],
            "purpose": row["purpose"], "status": "processed", "expires_at": row["expires_at"],
            "status_details": None}
