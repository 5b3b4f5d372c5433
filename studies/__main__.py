"""The paper's comparisons at laptop scale: a named study runs its train.py runs and reports them.

    python -m studies fig1b               # run (or continue) the study, then write its tables and plots
    python -m studies fig1b --dry_run     # its runs, the command of each, and the time the runs left take
    python -m studies fig1b --nproc=2     # each run on 2 processes (torchrun --standalone); same losses
    python -m studies fig1b --report      # its tables and plots from the runs done so far; trains nothing
    python -m studies deploy --only=n3200 # only the runs whose name matches a regular expression
    python -m studies --readme_table      # the README's table of the gguf studies, from their committed results
    python -m studies                     # the options and the studies (as --help)

Run from the repository's root. studies/README.md says how a study is run, resumed and reported, and
where its runs and results go.
"""
import os
import re
import signal
import sys

import configurator
from studies.definitions import REPO, STUDIES, runs_of
from studies.gguf_report import committed_readme_table
from studies.records import StudyError
from studies.runner import check_root, dry_run, run_study, write_results
from util import cli

DEFAULTS = dict(
    dry_run=False,  # list the study's runs, each one's state and command, and the time the runs left take
    report=False,  # write the study's tables and plots from the runs done so far; trains nothing
    nproc=1,  # each run on this many processes (torchrun --standalone): the same losses
    root="out/study",  # where the runs (ROOT/runs) and the results (ROOT/NAME) go
    only="",  # only the runs whose name matches this regular expression
    readme_table=False,  # print the README's table of the gguf studies from their committed results; runs nothing
)


def usage():
    """--help's head: the command, then each study with its count of runs and what it compares."""
    lines = ["usage: python -m studies NAME [--dry_run] [--report] [--nproc=N] [--root=DIR] [--only=REGEX]",
             "       python -m studies --readme_table",
             "studies (NAME; none: this help):"]
    lines += [f"  {n:6s} {len(runs_of(s)):3d} runs  {s['about']}" for n, s in STUDIES.items()]
    return "\n".join(lines)


def options(argv):
    """(the study's name or None, the options) of a command line, checked."""
    c, names = dict(DEFAULTS), []
    configurator.configure(c, argv, positional=names, usage=usage())
    configurator.check_at_least(c, {"nproc": 1})
    try:
        re.compile(c["only"])
    except re.error as e:
        raise StudyError(f"--only={c['only']!r} is not a regular expression ({e})") from None
    if not c["root"]:
        raise StudyError("--root= is empty; give the directory the runs and results go to")
    if len(names) > 1 or names and names[0] not in STUDIES:
        raise StudyError(f"{' '.join(names)!r} is not a study; usage: python -m studies NAME [--key=value ...]; "
                         f"studies: {', '.join(STUDIES)}")
    return (names or [None])[0], c


def _interrupted(signum, frame):
    raise KeyboardInterrupt


def main(argv):
    # Ctrl-C, and a kill, stop the run in progress and record the time it ran (launch), also where
    # the shell started the runner in the background with SIGINT ignored
    signal.signal(signal.SIGINT, _interrupted)
    signal.signal(signal.SIGTERM, _interrupted)
    name, c = options(argv)
    if c["readme_table"]:
        print("\n".join(committed_readme_table()))
        return 0
    if name is None:
        print(configurator.help_text(c, DEFAULTS, __file__, __doc__, usage()))
        return 0
    study = STUDIES[name]
    if c["only"] and not any(re.search(c["only"], n) for n, _, _ in runs_of(study)):
        raise StudyError(f"--only={c['only']!r} matches none of {name}'s {len(runs_of(study))} runs; "
                         f"`python -m studies {name} --dry_run` lists their names")
    # Config paths and train.py's out_dir are the repository's; --root may be given from anywhere.
    root = os.path.abspath(c["root"])
    check_root(root, made=not c["dry_run"])
    os.chdir(REPO)
    root = root if os.path.relpath(root).startswith("..") else os.path.relpath(root)
    if c["dry_run"]:
        return dry_run(name, study, root, c["nproc"], c["only"])
    if c["report"]:  # the tables and plots of the runs done so far, training nothing
        for path in write_results(name, study, root):
            print(f"[{name}] wrote {path}")
        return 0
    return 1 if run_study(name, study, root, c["nproc"], only=c["only"]) else 0


if __name__ == "__main__":
    try:
        sys.exit(cli(main))
    except KeyboardInterrupt:
        print("\ninterrupted; run the same command again to resume", file=sys.stderr)
        sys.exit(130)
