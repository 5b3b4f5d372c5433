"""llama.cpp's command-line tools (llama-quantize, llama-imatrix, llama-perplexity): where they are found
($LLAMA_CPP_BIN, PATH, the cache), their build into the cache from the source of the llama-cpp-python that
constraints.txt pins, and every call of one run within a time limit derived from its work.

    python export_gguf.py --build_llama_cpp          # build_llama_cpp(): into cache_bin(), once
    tool = build.require_tool("llama-quantize")      # or one line saying the three ways to get it
    status, output = build.run_tool(argv, "Q4_0 of model-fp32.gguf", build.time_limit(work_s))

What each call does and the check of what it wrote: tools.py.
"""
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile

from files.gguf_file import GGUFError
from util import atomic_dir, first_line

TOOLS = ("llama-quantize", "llama-imatrix", "llama-perplexity")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: its constraints.txt
# How build_llama_cpp configures llama.cpp: its command-line tools alone, Release (no tests, examples,
# server or unified binary), no OpenSSL (nothing downloaded), for any CPU with AVX2 rather than only this
# one (GGML_NATIVE=OFF turns AVX, AVX2, FMA, F16C on: a cache copied to another machine still runs), and
# static, so the three binaries copied into the cache need no library beside them.
CMAKE_OPTIONS = ("-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                 "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF", "-DGGML_NATIVE=OFF",
                 "-DBUILD_SHARED_LIBS=OFF")
# Each call of a tool runs within a time limit derived from its work (time_limit): TOOL_FLOOR_S (loading, a busy
# machine) plus its work at rates several times below those measured (docs/GGUF.md), so that only a hung tool
# reaches it; the build's steps: BUILD_SECONDS (the compile's in CPU seconds, shared by the cores it uses).
TOOL_FLOOR_S = 120.0
BUILD_SECONDS = dict(download=1800.0, configure=600.0, build=4 * 3600.0)
# What pip's retries say where no package index answers (the last one on a line is the most telling)
OFFLINE = re.compile(r"NewConnectionError|ConnectTimeoutError|ProxyError|Failed to establish a new connection|"
                     r"Temporary failure in name resolution|Name or service not known|Network is unreachable|"
                     r"Connection refused|Connection timed out|No route to host")


def pinned_version():
    """The version of llama-cpp-python that constraints.txt pins: the llama.cpp whose tools are built
    (its source distribution carries llama.cpp's sources in vendor/llama.cpp)."""
    path = os.path.join(ROOT, "constraints.txt")
    try:
        with open(path, encoding="utf-8") as f:
            found = re.search(r"^llama[-_]cpp[-_]python==(\S+)", f.read(), re.MULTILINE | re.IGNORECASE)
    except OSError as e:
        raise GGUFError(f"cannot read {path} ({first_line(e)}), which pins the llama.cpp to build") from None
    if found is None:
        raise GGUFError(f"{path} pins no llama_cpp_python==VERSION: the llama.cpp to build is that version's")
    return found.group(1)


def cache_bin(version=None):
    """The cache directory of the built tools: $XDG_CACHE_HOME (else ~/.cache)/pqt/llama.cpp-<version>/bin."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pqt", f"llama.cpp-{version or pinned_version()}", "bin")


def executable(path):
    """Whether path is a file this process may run."""
    return os.path.isfile(path) and os.access(path, os.X_OK)


def llama_cpp_tool(name):
    """The path of llama.cpp's command-line tool `name` (TOOLS): in the directory $LLAMA_CPP_BIN names
    (where set, there only), else on PATH, else in the cache build_llama_cpp fills; None where absent."""
    folder = os.environ.get("LLAMA_CPP_BIN")
    if folder:
        path = os.path.join(folder, name)
        return path if executable(path) else None
    path = os.path.join(cache_bin(), name)
    return shutil.which(name) or (path if executable(path) else None)


def require_tool(name):
    """llama_cpp_tool(name), or GGUFError: one line saying the three ways to get it."""
    tool = llama_cpp_tool(name)
    if tool is None:
        where = (f"not in $LLAMA_CPP_BIN ({os.environ['LLAMA_CPP_BIN']})" if os.environ.get("LLAMA_CPP_BIN")
                 else "not on PATH nor in the cache")
        raise GGUFError(f"{name} not found ({where}): set LLAMA_CPP_BIN to the directory of llama.cpp's tools, put "
                        f"them on PATH, or build them into {cache_bin()} with python export_gguf.py --build_llama_cpp "
                        f"(cmake and ninja; about 25 minutes on 2 cores)")
    return tool


def build_commands(version, work, jobs):
    """[(what, argv, seconds of work)] build_llama_cpp runs in the folder work: the download of
    llama-cpp-python's source distribution (its .tar.gz is unpacked between the first and the second),
    cmake's configure of its vendor/llama.cpp, and the build of TOOLS by `jobs` processes; the seconds of
    work are each step's at BUILD_SECONDS (the build's shared by the cores it uses), time_limit's work_s."""
    source = os.path.join(work, f"llama_cpp_python-{version}", "vendor", "llama.cpp")
    build = os.path.join(work, "build")
    cores = max(1, min(jobs, os.cpu_count() or 1))
    return [("pip download of llama-cpp-python's source", [sys.executable, "-m", "pip", "download", "--no-binary",
                                                            ":all:", "--no-deps", f"llama-cpp-python=={version}",
                                                            "-d", work], BUILD_SECONDS["download"]),
            ("cmake's configure of llama.cpp", ["cmake", "-S", source, "-B", build, *CMAKE_OPTIONS],
             BUILD_SECONDS["configure"]),
            ("the build of llama.cpp's tools", ["cmake", "--build", build, "--target", *TOOLS, "-j", str(jobs)],
             BUILD_SECONDS["build"] / cores)]


def time_limit(work_s, tool_timeout=0.0):
    """The seconds a call of a tool may run: tool_timeout where it is > 0 (export_gguf.py's --tool_timeout),
    else TOOL_FLOOR_S (loading, a busy machine) plus work_s, its work at the pessimistic rates above."""
    return float(tool_timeout) if tool_timeout > 0 else TOOL_FLOOR_S + work_s


def run_tool(argv, what, limit, log=None):
    """Run argv to its end within `limit` seconds, in a session of its own, so that a hung tool and its
    children are stopped together (also where this process is interrupted); its output captured, or
    appended to the file object log. Returns (exit status, output). GGUFError, one line naming the tool,
    where it cannot start or runs past the limit."""
    name = os.path.basename(argv[0])
    try:
        proc = subprocess.Popen(argv, stdout=log or subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    except OSError as e:
        raise GGUFError(f"{what} could not start {argv[0]} ({first_line(e)}): is {name} installed and "
                        f"executable?") from None
    try:
        output, _ = proc.communicate(timeout=limit)
    except BaseException as e:  # past the limit, or interrupted: the tool's whole session goes
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # it had ended
            pass
        proc.communicate()
        if not isinstance(e, subprocess.TimeoutExpired):
            raise
        raise GGUFError(f"{name} ({what}) did not finish within {limit:.0f} s and was stopped: it hung, or this "
                        f"machine is slower than that limit allows (--tool_timeout=SECONDS sets another); nothing "
                        f"it made was kept") from None
    return proc.returncode, output or ""


def _run_logged(what, argv, limit, log_path):
    """argv (run_tool, within limit seconds), its output appended to log_path; GGUFError (one line: its
    last line, or that no package index answered) where it fails."""
    with open(log_path, "a", encoding="utf-8") as out:
        out.write(f"$ {' '.join(argv)}\n")
        out.flush()
        status, _ = run_tool(argv, what, limit, log=out)
    if status != 0:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()] or ["no output"]
        offline = [found[-1] for found in map(OFFLINE.findall, lines) if found]
        if offline:  # pip ends with "No matching distribution found": the cause is in its retries before
            raise GGUFError(f"{what} failed: no package index answered ({offline[-1]}); the build downloads "
                            f"llama-cpp-python's source with pip: connect to the network (or set pip's index), or "
                            f"set LLAMA_CPP_BIN to the directory of llama.cpp's tools built elsewhere (the whole "
                            f"output: {log_path})")
        raise GGUFError(f"{what} failed (exit status {status}): {lines[-1][:300]} (the whole output: {log_path})")


def build_llama_cpp(jobs=0, log=print, tool_timeout=0.0):
    """Build llama.cpp's TOOLS from the source distribution of the llama-cpp-python that constraints.txt
    pins (pinned_version) into cache_bin(): pip downloads it, cmake and ninja build its vendor/llama.cpp
    (CMAKE_OPTIONS) with `jobs` processes (0: one per core) in a temporary folder, and the three binaries
    replace the cache's at once (util.atomic_dir). A complete cache is kept as it is. Each step runs
    within its time_limit (tool_timeout: time_limit's). Returns the cache directory; GGUFError (one line)
    for a missing cmake or ninja or a step that fails, whose output is in build.log beside the cache."""
    version = pinned_version()
    target = cache_bin(version)
    if all(executable(os.path.join(target, name)) for name in TOOLS):
        log(f"llama.cpp's tools ({version}) are built already: {target}")
        return target
    missing = [name for name in ("cmake", "ninja") if shutil.which(name) is None]
    if missing:
        raise GGUFError(f"{' and '.join(missing)} not found: building llama.cpp's tools needs cmake, ninja and a C++ "
                        f"compiler (apt-get install cmake ninja-build g++, or pip install cmake ninja)")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    log_path = os.path.join(os.path.dirname(target), "build.log")
    open(log_path, "w").close()
    with tempfile.TemporaryDirectory(prefix="pqt-llama.cpp-") as work:
        (download, *steps) = build_commands(version, work, jobs or os.cpu_count())
        log(f"downloading llama-cpp-python {version}'s source distribution (about 77 MB) ...")
        _run_logged(*download[:2], time_limit(download[2], tool_timeout), log_path)
        with tarfile.open(os.path.join(work, f"llama_cpp_python-{version}.tar.gz")) as sdist:
            sdist.extractall(work, filter="data")
        log(f"building {', '.join(TOOLS)} (about 25 minutes on 2 cores; output in {log_path}) ...")
        for what, argv, work_s in steps:
            _run_logged(what, argv, time_limit(work_s, tool_timeout), log_path)
        if os.path.isdir(target):  # a cache lacking a tool (removed by hand): replaced whole
            shutil.rmtree(target)
        with atomic_dir(target) as staged:
            for name in TOOLS:
                shutil.copy2(os.path.join(work, "build", "bin", name), staged)
    log(f"built {', '.join(TOOLS)} into {target}")
    return target
