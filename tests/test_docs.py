"""Every block of the docs (``docs/*.md``) and the README that claims to run is run here.

The convention (stated for readers in ``docs/index.md``, "How the examples are checked"):

* a ```` ```python ```` block runs as a script (a fresh ``python`` of this venv, at the repo root);
* a ```` ```console ```` block runs each ``$ `` line in bash at the repo root -- a command goes on
  over the next lines while it ends in ``\\`` or has a quote open; the other lines are output
  shown to the reader, not compared. ``pagedhybrid``, ``python`` and ``pip`` are this venv's;
* ``$ pagedhybrid serve ... --port 8000`` starts that server (once per page and command line) on a
  free 127.0.0.1 port instead, and waits for ``/health``; every later block of the same page
  reaches it, with ``:8000`` replaced by that port;
* a block whose info string carries ``title="not run here: REASON"`` is not run (Material shows
  the title, and so the reason, above the block); ``bash`` / ``sh`` / ``shell`` blocks must carry
  it (anything meant to run is ``console`` or ``python``); other languages (``text``, ``json``,
  ``js``, ...) are never run.

Each block is one test case, in page order (~45 blocks, four server starts). The whole file takes
~5 minutes on 2 busy cores -- each block is a fresh process that loads the built-in model -- so
the blocks are marked slow. The site's own build (``mkdocs build --strict``) is ``make docs``, a
prerequisite of ``make test``, not a test here.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from server_process import free_port, wait_healthy

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
VENV_BIN = Path(sys.executable).parent
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
NOT_RUN = re.compile(r'title="not run here: [^"]+"')
RUNNABLE = ("python", "console")
MUST_MARK = ("bash", "sh", "shell", "zsh")
PORT = "8000"
SERVE = re.compile(rf"^pagedhybrid serve\b.*--port {PORT}\b", re.DOTALL)
TIMEOUT_S = 300


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    info: str
    text: str
    serve: str | None  # the page's last `$ pagedhybrid serve` command before (or in) this block

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def not_run(self) -> bool:
        return bool(NOT_RUN.search(self.info))


def commands(text: str) -> list[str]:
    """The ``$ `` commands of a console block, continuation lines joined."""
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("$ "):
            i += 1
            continue
        cmd = lines[i][2:]
        i += 1
        while i < len(lines) and (cmd.rstrip().endswith("\\") or not _closed(cmd)):
            cmd += "\n" + lines[i]
            i += 1
        out.append(cmd.strip())
    return out


def _closed(cmd: str) -> bool:
    try:
        shlex.split(cmd, comments=True)
    except ValueError:
        return False
    return True


def parse(page: Path) -> list[Block]:
    blocks: list[Block] = []
    lines = page.read_text().splitlines()
    serve: str | None = None
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m["indent"], m["fence"], m["info"].strip()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not (lines[i].strip().startswith(fence)
                                      and lines[i].strip().strip(fence[0]) == ""):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1
        lang = info.split()[0] if info else ""
        text = "\n".join(body) + "\n"
        block = Block(page, start + 1, lang, info, text, serve)
        if lang == "console" and not block.not_run:
            for cmd in commands(text):
                if SERVE.match(cmd):
                    serve = cmd
            block = Block(page, start + 1, lang, info, text, serve)
        blocks.append(block)
    return blocks


BLOCKS = [b for page in PAGES for b in parse(page)]
RUN = [b for b in BLOCKS if b.lang in RUNNABLE and not b.not_run]


def test_blocks_that_look_runnable_are_runnable_or_marked() -> None:
    unmarked = [b.id for b in BLOCKS if b.lang in MUST_MARK and not b.not_run]
    assert not unmarked, (f"{unmarked}: a bash block is either a ```console block of `$ ` "
                          'commands (run by this test) or marked title="not run here: REASON"')
    empty = [b.id for b in RUN if b.lang == "console" and not commands(b.text)]
    assert not empty, f"{empty}: a console block without a `$ ` command"
    assert len(RUN) >= 20  # the docs do carry runnable examples


def test_readme_opens_with_make_run_and_make_test() -> None:
    first = next(b for b in BLOCKS if b.page.name == "README.md")
    assert [c.split("#")[0].strip() for c in commands(first.text)][:2] == ["make run",
                                                                           "make test"]


# -- servers ------------------------------------------------------------------------------------
def _env() -> dict[str, str]:
    return {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONUNBUFFERED": "1", "NO_COLOR": "1"}


class Servers:
    """The server a page's blocks talk to; one at a time (a new page's stops the last)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.key: tuple[Path, str] | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    def ensure(self, page: Path, cmd: str) -> int:
        if self.key == (page, cmd) and self.proc is not None and self.proc.poll() is None:
            return self.port
        self.stop()
        port = free_port()
        line = cmd.rstrip().removesuffix("&").rstrip()
        line = line.replace(f"--port {PORT}", f"--host 127.0.0.1 --port {port}")
        log = self.tmp / f"serve-{port}.log"
        proc = subprocess.Popen(["bash", "-c", f"exec {line}"], cwd=ROOT, env=_env(),
                                stdout=log.open("wb"), stderr=subprocess.STDOUT)
        wait_healthy(proc, f"http://127.0.0.1:{port}", log, repr(cmd))
        self.key, self.proc, self.port = (page, cmd), proc, port
        return port

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.key, self.proc = None, None


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    s = Servers(tmp_path_factory.mktemp("docs-serve"))
    yield s
    s.stop()


def _ported(text: str, port: int | None) -> str:
    if port is None:
        return text
    return re.sub(rf"(localhost|127\.0\.0\.1):{PORT}\b", rf"\1:{port}", text)


def _run(argv: list[str], what: str) -> None:
    r = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=TIMEOUT_S)
    assert r.returncode == 0, (f"{what} exited {r.returncode}\n--- stdout\n{r.stdout[-4000:]}"
                               f"\n--- stderr\n{r.stderr[-4000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("block", RUN, ids=[b.id for b in RUN])
def test_block_runs(block: Block, servers: Servers, tmp_path: Path) -> None:
    needs_server = re.search(rf"(localhost|127\.0\.0\.1):{PORT}\b", block.text) is not None
    port = None
    if needs_server:
        assert block.serve is not None, (f"{block.id} talks to :{PORT}, but no "
                                         f"`$ pagedhybrid serve --port {PORT}` comes before it")
        port = servers.ensure(block.page, block.serve)
    if block.lang == "python":
        script = tmp_path / "block.py"
        script.write_text(_ported(block.text, port))
        _run([sys.executable, str(script)], f"{block.id} (python)")
        return
    for cmd in commands(block.text):
        if SERVE.match(cmd):
            servers.ensure(block.page, cmd)
            continue
        _run(["bash", "-c", f"set -eo pipefail\n{_ported(cmd, port)}"], f"{block.id}: {cmd!r}")
