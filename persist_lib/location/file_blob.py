"""A Blob on a local directory (``file://DIR``): the embedded default.

Why it looks the way it does:

- **Atomic, durable set**: the value goes to a unique temp file in the target
  directory (``.tmp-<uuid>``), which is fsynced, renamed over the final name, and the
  directory is fsynced, so a reader sees the old value or the new one and a crash
  never leaves a torn blob behind a valid name (only stray temp files, which listing
  skips).
- **Keys can't escape the root**: a key must match a strict grammar (ASCII segments
  ``[A-Za-z0-9_=-][A-Za-z0-9_.=-]*`` joined by ``/``; so no ``..``, no leading ``/``, no
  NUL, backslash or unicode look-alikes, no hidden names, bounded length). On top of
  that the resolved path must stay inside the root (``realpath`` + ``commonpath``), and
  every path component is opened relative to its parent directory's file descriptor
  with ``O_NOFOLLOW``: a symlink planted under the root is never followed, by any
  operation (it is reported as ``InvalidBlobKey``).
- Keys map to nested directories (``a/b/c`` -> ``ROOT/a/b/c``). A key can therefore
  not be both a blob and a "directory" of other blobs (``a`` and ``a/b``); writing
  the second of such a pair raises ``InvalidBlobKey``. Persist's key layout never does.
- ``OSError`` becomes ``Determinate`` (naming the key, the root and the errno), except
  when the rename already happened (then ``Indeterminate``: the blob may be visible).
- ``delete`` does not fsync the directory (GC re-deletes idempotently) and leaves empty
  directories in place (removing them would race with concurrent ``set``).
"""

from __future__ import annotations

import errno
import os
import re
import stat
import uuid
from collections.abc import Iterator

from persist_lib.errors import Determinate, Indeterminate, InvalidBlobKey
from persist_lib.location.base import Blob, BlobMetadata, check_range

__all__ = ["FileBlob", "MAX_KEY_LEN", "validate_key"]

MAX_KEY_LEN = 1024
MAX_SEGMENT_LEN = 255
TEMP_PREFIX = ".tmp-"

_SEGMENT = r"[A-Za-z0-9_=\-][A-Za-z0-9_.=\-]*"
_SEGMENT_RE = re.compile(_SEGMENT)
_KEY_RE = re.compile(rf"{_SEGMENT}(?:/{_SEGMENT})*")
KEY_GRAMMAR = (
    "segments of ASCII letters, digits, '_', '-', '=' and '.' (not first) joined by '/', "
    f"at most {MAX_SEGMENT_LEN} characters per segment and {MAX_KEY_LEN} in total"
)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _key_problem(key: object) -> str | None:
    """Why ``key`` breaks the grammar (``None`` if it doesn't)."""
    if not isinstance(key, str):
        return f"keys are str, got {type(key).__name__}"
    if not key:
        return "the key is empty"
    if len(key) > MAX_KEY_LEN:
        return f"the key is {len(key)} characters long (max {MAX_KEY_LEN})"
    if "\x00" in key:
        return "NUL characters are not allowed"
    if "\\" in key:
        return "backslashes are not allowed"
    if not key.isascii():
        return "only ASCII characters are allowed (no unicode look-alikes)"
    if key.startswith("/"):
        return "absolute keys (leading '/') are not allowed"
    if key.endswith("/"):
        return "a trailing '/' is not allowed"
    for seg in key.split("/"):
        if seg == "":
            return "empty segments ('//') are not allowed"
        if seg in (".", ".."):
            return f"'{seg}' segments are not allowed"
        if seg.startswith("."):
            return f"segment {seg!r} starts with '.' (reserved for temp files)"
        if len(seg) > MAX_SEGMENT_LEN:
            return f"a segment is {len(seg)} characters long (max {MAX_SEGMENT_LEN})"
        if not _SEGMENT_RE.fullmatch(seg):
            bad = sorted({c for c in seg if not (c.isalnum() or c in "_.=-")})
            return f"segment {seg!r} contains disallowed character(s) {bad!r}"
    if not _KEY_RE.fullmatch(key):  # pragma: no cover - belt and braces
        return "the key does not match the key grammar"
    return None


def validate_key(key: str) -> list[str]:
    """The segments of ``key``; raises ``InvalidBlobKey`` naming the key and the rule."""
    problem = _key_problem(key)
    if problem is not None:
        shown = (
            repr(key) if not isinstance(key, str) or len(key) <= 200 else repr(key[:200]) + "..."
        )
        raise InvalidBlobKey(f"invalid blob key {shown}: {problem}; keys must be {KEY_GRAMMAR}")
    return key.split("/")


class _SymlinkRefused(Exception):
    pass


class _Conflict(Exception):
    pass


class FileBlob(Blob):
    """A Blob in a local directory. Safe for concurrent use by threads and processes."""

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = True) -> None:
        raw = os.fspath(root)
        if not raw or "\x00" in raw:
            raise InvalidBlobKey(f"invalid file blob root {raw!r}")
        try:
            os.makedirs(raw, exist_ok=True)
        except OSError as e:
            raise Determinate(
                f"file blob: cannot create root directory {raw!r}: {e.strerror} "
                f"({errno.errorcode.get(e.errno or 0, e.errno)}); check the path and permissions"
            ) from None
        self.root = os.path.realpath(raw)
        self.fsync = fsync

    # -- helpers -------------------------------------------------------------------

    def describe(self) -> str:
        return f"file://{self.root}"

    def __repr__(self) -> str:
        return f"FileBlob({self.root!r})"

    def _check(self, key: str) -> list[str]:
        segs = validate_key(key)
        path = os.path.join(self.root, *segs)
        real = os.path.realpath(path)
        if os.path.commonpath([self.root, real]) != self.root:
            raise InvalidBlobKey(
                f"blob key {key!r} resolves outside the blob root {self.root!r} (through a "
                "symlink under the root); refusing to follow it"
            )
        return segs

    def _error(self, op: str, key: str, e: OSError, *, applied: bool = False) -> Exception:
        code = errno.errorcode.get(e.errno or 0, str(e.errno))
        hint = {
            errno.ENOSPC: "free disk space and retry",
            errno.EDQUOT: "raise the disk quota and retry",
            errno.EACCES: "check the permissions of the blob directory",
            errno.EPERM: "check the permissions of the blob directory",
            errno.EROFS: "the file system is read-only",
            errno.EMFILE: "too many open files; raise the limit",
        }.get(e.errno or 0, "retry; if it persists, check the blob directory")
        what = "may have been applied" if applied else "did not happen"
        msg = (
            f"file blob {self.root!r}: {op} of key {key!r} failed ({code}: {e.strerror}); "
            f"the {op} {what}; {hint}"
        )
        return Indeterminate(msg) if applied else Determinate(msg)

    def _symlink_error(self, key: str) -> InvalidBlobKey:
        return InvalidBlobKey(
            f"blob key {key!r}: a path component under the blob root {self.root!r} is a "
            "symlink; symlinks are never followed (remove it)"
        )

    def _conflict_error(self, key: str) -> InvalidBlobKey:
        return InvalidBlobKey(
            f"blob key {key!r} conflicts with an existing blob or key prefix under "
            f"{self.root!r}: a file blob can't hold both 'a' and 'a/b' style keys"
        )

    def _open_dirs(self, segs: list[str], *, create: bool) -> int:
        """An fd of ROOT/segs..., walked with O_NOFOLLOW (the caller closes it).

        Raises FileNotFoundError if a directory is missing (and ``create`` is false),
        ``_SymlinkRefused`` for a symlinked component, ``_Conflict`` if a component is a
        regular file.
        """
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for seg in segs:
                if create:
                    try:
                        os.mkdir(seg, 0o755, dir_fd=fd)
                        if self.fsync:
                            os.fsync(fd)  # make the new directory entry durable
                    except FileExistsError:
                        pass
                try:
                    nfd = os.open(seg, _DIR_FLAGS, dir_fd=fd)
                except OSError as e:
                    if e.errno in (errno.ELOOP, errno.ENOTDIR):
                        st = os.stat(seg, dir_fd=fd, follow_symlinks=False)
                        if stat.S_ISLNK(st.st_mode):
                            raise _SymlinkRefused() from None
                        raise _Conflict() from None
                    raise
                os.close(fd)
                fd = nfd
            return fd
        except BaseException:
            os.close(fd)
            raise

    # -- Blob ----------------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        return self._read(key, None)

    def get_range(self, key: str, start: int, end: int) -> bytes | None:
        check_range(key, start, end)
        return self._read(key, (start, end))

    def _read(self, key: str, rng: tuple[int, int] | None) -> bytes | None:
        """The value of ``key`` (``rng``: only bytes ``[start, end)`` of it)."""
        segs = self._check(key)
        try:
            try:
                dfd = self._open_dirs(segs[:-1], create=False)
            except (FileNotFoundError, _Conflict):
                return None
            try:
                try:
                    fd = os.open(segs[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
                except FileNotFoundError:
                    return None
                except OSError as e:
                    if e.errno == errno.ELOOP:
                        raise _SymlinkRefused() from None
                    if e.errno == errno.EISDIR:
                        return None
                    raise
            finally:
                os.close(dfd)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return None
                if rng is not None:
                    return os.pread(fd, rng[1] - rng[0], rng[0]) if rng[1] > rng[0] else b""
                with os.fdopen(fd, "rb", closefd=False) as f:
                    return f.read()
            finally:
                os.close(fd)
        except _SymlinkRefused:
            raise self._symlink_error(key) from None
        except OSError as e:
            raise self._error("get", key, e) from None

    def set(self, key: str, value: bytes) -> None:
        segs = self._check(key)
        data = memoryview(value).cast("B")
        renamed = False
        try:
            dfd = self._open_dirs(segs[:-1], create=True)
            try:
                tmp = f"{TEMP_PREFIX}{uuid.uuid4().hex}"
                fd = os.open(
                    tmp,
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                    0o644,
                    dir_fd=dfd,
                )
                try:
                    try:
                        off = 0
                        while off < len(data):
                            off += os.write(fd, data[off:])
                        if self.fsync:
                            os.fsync(fd)
                    finally:
                        os.close(fd)
                    try:
                        os.rename(tmp, segs[-1], src_dir_fd=dfd, dst_dir_fd=dfd)
                    except OSError as e:
                        if e.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
                            raise _Conflict() from None
                        raise
                    renamed = True
                finally:
                    if not renamed:
                        try:
                            os.unlink(tmp, dir_fd=dfd)
                        except OSError:
                            pass
                if self.fsync:
                    os.fsync(dfd)
            finally:
                os.close(dfd)
        except _SymlinkRefused:
            raise self._symlink_error(key) from None
        except _Conflict:
            raise self._conflict_error(key) from None
        except OSError as e:
            raise self._error("set", key, e, applied=renamed) from None

    def delete(self, key: str) -> int | None:
        segs = self._check(key)
        try:
            try:
                dfd = self._open_dirs(segs[:-1], create=False)
            except (FileNotFoundError, _Conflict):
                return None
            try:
                try:
                    st = os.stat(segs[-1], dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    return None
                if stat.S_ISLNK(st.st_mode):
                    raise _SymlinkRefused()
                if not stat.S_ISREG(st.st_mode):
                    return None
                try:
                    os.unlink(segs[-1], dir_fd=dfd)
                except FileNotFoundError:
                    return None  # a concurrent delete won
                return st.st_size
            finally:
                os.close(dfd)
        except _SymlinkRefused:
            raise self._symlink_error(key) from None
        except OSError as e:
            raise self._error("delete", key, e) from None

    def list_keys_and_metadata(self, prefix: str) -> Iterator[BlobMetadata]:
        if not isinstance(prefix, str):
            raise InvalidBlobKey(f"blob prefix must be a str, got {type(prefix).__name__}")
        dir_part, _, _ = prefix.rpartition("/")
        segs = dir_part.split("/") if dir_part else []
        if any(not _SEGMENT_RE.fullmatch(s) for s in segs):
            return  # no valid key starts with this prefix
        out: list[BlobMetadata] = []
        try:
            try:
                fd = self._open_dirs(segs, create=False)
            except (FileNotFoundError, _Conflict, _SymlinkRefused):
                return
            try:
                self._walk(fd, dir_part, prefix, out)
            finally:
                os.close(fd)
        except OSError as e:
            raise self._error("list", prefix, e) from None
        out.sort(key=lambda m: m.key)
        yield from out

    def _walk(self, fd: int, base: str, prefix: str, out: list[BlobMetadata]) -> None:
        with os.scandir(fd) as it:
            entries = list(it)
        for entry in entries:
            name = entry.name
            if name.startswith(".") or not _SEGMENT_RE.fullmatch(name):
                continue  # temp files and anything that is not a key
            key = f"{base}/{name}" if base else name
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # deleted concurrently
            if stat.S_ISDIR(st.st_mode):
                if not (key + "/").startswith(prefix) and not prefix.startswith(key + "/"):
                    continue
                try:
                    sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except (FileNotFoundError, NotADirectoryError):
                    continue
                except OSError as e:
                    if e.errno == errno.ELOOP:
                        continue  # swapped for a symlink: never followed
                    raise
                try:
                    self._walk(sub, key, prefix, out)
                finally:
                    os.close(sub)
            elif stat.S_ISREG(st.st_mode) and key.startswith(prefix):
                out.append(BlobMetadata(key, st.st_size, st.st_mtime_ns // 1_000_000))
            # symlinks and other file types are skipped: never followed, never listed

    def cleanup_temp_files(self, older_than_s: float = 3600.0) -> int:
        """Removes temp files (``.tmp-*``) left by crashed writers; returns how many."""
        import time

        cutoff = time.time() - older_than_s
        n = 0
        for dirpath, _dirs, files in os.walk(self.root, followlinks=False):
            for f in files:
                if f.startswith(TEMP_PREFIX):
                    p = os.path.join(dirpath, f)
                    try:
                        st = os.lstat(p)
                        if stat.S_ISREG(st.st_mode) and st.st_mtime < cutoff:
                            os.unlink(p)
                            n += 1
                    except OSError:
                        pass
        return n
