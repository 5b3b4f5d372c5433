"""Filesystem faults for the tests of unusable output places and full disks: a directory in which no
file can be made, writes that fail half-way with ENOSPC (as a disk that fills), and, where the
platform allows it, a really full filesystem (a tiny tmpfs in a private mount namespace)."""
import errno
import os
import shutil
import subprocess
import tempfile

import pytest


def no_space():
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def read_only_dir(tmp_path):
    """A directory in which no file can be made: mode 0555, or, for root (whom modes do not bind),
    sysfs, which refuses new files to everyone."""
    d = tmp_path / "read-only"
    d.mkdir()
    d.chmod(0o555)
    for candidate in (str(d), "/sys"):
        try:
            os.rmdir(tempfile.mkdtemp(dir=candidate))
        except OSError:
            return candidate
    pytest.skip("no directory here refuses new files (running as root, and no sysfs)")


class _FillingFile:
    """A file opened for writing on a disk that fills: half of the first write lands, then ENOSPC; with a
    marker, a write of data that holds it fails whole and the others land."""

    def __init__(self, f, marker=None):
        self._f, self._marker = f, marker

    def write(self, data):
        if self._marker is None:
            self._f.write(data[:len(data) // 2])
            self._f.flush()
            raise no_space()
        if (self._marker if isinstance(data, str) else self._marker.encode()) in data:
            raise no_space()
        return self._f.write(data)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def full_disk_open(real_open=open, marker=None):
    """An open() (or os.fdopen()) whose files opened for writing fill the disk (_FillingFile: at the first
    write, or at a write of data that holds marker); reading is as usual."""
    def fake_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return _FillingFile(f, marker) if any(c in mode for c in "wax+") else f
    return fake_open


def tiny_tmpfs(mountpoint, size="64k"):
    """The command prefix that runs a command with a tmpfs of `size` mounted at mountpoint, in a mount
    namespace of its own (nothing outside sees it): as root, or else in a user namespace of its own
    (`unshare -r`, where the kernel lets unprivileged users make them); skips where neither is permitted."""
    os.makedirs(mountpoint, exist_ok=True)
    mount = ["sh", "-c", f'mount -t tmpfs -o size={size} tmpfs "$0" && exec "$@"', str(mountpoint)]
    for flags in (["-m"], ["-r", "-m"]):
        prefix = ["unshare", *flags, *mount]
        if shutil.which("unshare") and not subprocess.run([*prefix, "true"], capture_output=True).returncode:
            return prefix
    pytest.skip("a private tmpfs needs unshare and mount permission (root, or unprivileged user namespaces), "
                "not here")
