"""Every shell command README.md shows, read from README.md itself, so that the two cannot drift apart.

A command is an indented code block's line, or an inline code span, that starts with ``python ``,
``autoplan ``, ``pip install `` or ``torchrun `` (``a && b`` is two commands). Each is checked against
the argument parser of the program it starts, options in ``[...]`` with and without them. Then each
one this machine can run runs for real as the README spells it, in a temporary folder and in README
order (``plan.json`` written by one is read by the next; ``a.json`` and ``b.json`` stand for any two
plans: the main job's and ``autoplan plan``'s):

- by default: the ``autoplan`` commands but ``calibrate``, and the main job, ``python examples/example_llama3.py``;
- marked slow: ``autoplan calibrate``, ``--execute``, the benchmarks and ``torchrun`` on this one machine;
- never run here: ``pip install`` (it would change this environment: the extras it names are checked
  against pyproject.toml instead), ``python -m pytest`` (the suite itself: the markers it selects are
  checked), and ``torchrun`` over several nodes (it needs a cluster: torchrun's parser and the
  script's check its flags).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser as torchrun_parser

from autoplan import Plan
from autoplan.cost.devices import resolve_profile

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PREFIXES = ("python ", "autoplan ", "pip install ", "torchrun ")
# placeholder plans of the README: each is a copy of a plan an earlier command wrote
PLACEHOLDERS = {"a.json": "llama3_8b_16x8.json", "b.json": "plan.json"}


def readme_commands() -> list[str]:
    """The README's commands in the order they appear, whitespace as a shell reads it."""
    text = re.sub(r"(?ms)^```.*?^```\n", "", README.read_text())  # fenced blocks hold Python, not commands
    snippets = [(m.start(), m.group(1)) for m in re.finditer(r"(?m)^ {4}(\S.*)$", text)]
    snippets += [(m.start(), m.group(1)) for m in re.finditer(r"`([^`]+)`", text)]
    commands = []
    for _, snippet in sorted(snippets):
        for part in " ".join(snippet.split()).split(" && "):
            if part.startswith(PREFIXES):
                commands.append(part)
    return commands


COMMANDS = readme_commands()


def variants(command: str) -> list[list[str]]:
    """The command's words without its ``[optional words]``, then with them."""
    base, full, optional = [], [], False
    for word in shlex.split(command):
        optional = optional or word.startswith("[")
        full.append(word.strip("[]") if optional else word)
        if not optional:
            base.append(word)
        elif word.endswith("]"):
            optional = False
    return [base] if base == full else [base, full]


def _multi_node(words: list[str]) -> bool:
    args = torchrun_parser().parse_args(words[1:])
    return str(args.nnodes) not in ("1", "1:1")


def kind(command: str) -> str:
    """``run`` (fast), ``slow`` (run under -m slow) or ``parse`` (checked, never run here)."""
    words = variants(command)[0]
    if words[0] == "pip" or words[1:3] == ["-m", "pytest"]:
        return "parse"
    if words[0] == "torchrun":
        return "parse" if _multi_node(words) else "slow"
    if words[:2] == ["autoplan", "calibrate"]:
        return "slow"  # it measures this machine for ~20 s; test_calibrate runs its fast mode by default
    if words[0] == "autoplan" or words == ["python", "examples/example_llama3.py"]:
        return "run"
    return "slow"


def _script_parser(path: str):
    """``build_parser()`` of a script of this repository, loaded from its file."""
    spec = importlib.util.spec_from_file_location(f"readme_{Path(path).stem}", ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_parser()


def _check_pip(words: list[str]) -> None:
    assert words[:3] == ["pip", "install", "-e"] and len(words) == 4, f"expected 'pip install -e .[extras]': {words}"
    target, _, extras = words[3].partition("[")
    assert target == ".", f"pip installs {target!r}, not this repository"
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in filter(None, extras.rstrip("]").split(",")):
        assert extra in declared, f"pip install names extra {extra!r}; pyproject.toml declares {sorted(declared)}"


def _check_pytest(args: list[str]) -> None:
    markers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    declared = {m.partition(":")[0] for m in markers}
    words = iter(args)
    for word in words:
        if word == "-m":
            names = set(re.findall(r"\w+", next(words))) - {"not", "and", "or"}
            assert names <= declared, f"-m selects {sorted(names - declared)}; pyproject.toml declares {declared}"
        else:
            assert word == "-q", f"unexpected pytest argument {word!r} in the README"


def check_parses(words: list[str]) -> None:
    """Hand ``words`` to the parser of the program they start (argparse exits on a bad flag)."""
    if words[0] == "pip":
        return _check_pip(words)
    if words[0] == "autoplan":
        from autoplan.cli import build_parser

        build_parser().parse_args(words[1:])
    elif words[0] == "torchrun":
        args = torchrun_parser().parse_args(words[1:])
        module = importlib.import_module(args.training_script) if args.module else None
        (module.build_parser() if module else _script_parser(args.training_script)).parse_args(
            args.training_script_args
        )
    elif words[1:3] == ["-m", "pytest"]:
        _check_pytest(words[3:])
    elif words[1] == "-m":
        importlib.import_module(words[2]).build_parser().parse_args(words[3:])
    else:
        assert words[1].endswith(".py"), f"no check for {' '.join(words)}"
        _script_parser(words[1]).parse_args(words[2:])


def test_readme_shows_the_commands_it_promises():
    """The parse found the README's commands (a change of its layout must not leave this test empty)."""
    assert "python examples/example_llama3.py" in COMMANDS
    assert "python examples/example_llama3.py --model debug --execute" in COMMANDS
    assert "autoplan plan --model llama3-8b --mesh 16x8 --mp bf16 -o plan.json" in COMMANDS
    assert {kind(c) for c in COMMANDS} == {"run", "slow", "parse"}


@pytest.mark.parametrize("command", COMMANDS, ids=COMMANDS)
def test_readme_command_parses(command):
    for words in variants(command):
        check_parses(words)


def _executable(name: str) -> str:
    """``python`` is this interpreter; a console script is looked for beside it, then on the PATH."""
    if name == "python":
        return sys.executable
    beside = Path(sys.executable).with_name(name)
    found = str(beside) if beside.exists() else shutil.which(name)
    assert found, f"{name} is not installed (pip install -e .)"
    return found


def run_command(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run ``command`` as the README spells it (its optional words left out) in ``cwd``, where the
    repository's ``examples`` folder is linked, with this checkout first on the Python path."""
    words = variants(command)[0]
    if not (cwd / "examples").exists():
        (cwd / "examples").symlink_to(ROOT / "examples")
    for name, source in PLACEHOLDERS.items():
        if name in words and not (cwd / name).exists():
            shutil.copy(cwd / source, cwd / name)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run(
        [_executable(words[0]), *words[1:]], cwd=cwd, env=env, capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    assert "Running HiGHS" not in done.stdout + done.stderr, f"{command} printed the solver's banner"
    return done


def check_output(command: str, out: str, cwd: Path) -> None:
    """What each command must have done, beyond exiting with 0."""
    words = variants(command)[0]
    if words == ["python", "examples/example_llama3.py"]:
        assert "autoplan plan on mesh (dp=16, tp=8)" in out and "layers.*.attention.wq.weight" in out
        plan = Plan.from_json(cwd / "llama3_8b_16x8.json")
        assert plan.mesh_shape == (16, 8) and len(plan.param_placements) == 2 + 9 * 32 + 1
        assert plan.memory.param_bytes <= 8.1e9 * 4 / 128  # the 1/128 budget of the fp32 parameters held
        assert plan.precision == {"param_dtype": "bfloat16", "reduce_dtype": "float32"}  # 8B: mixed precision
    elif words[:2] == ["autoplan", "plan"]:
        out_file = words[words.index("-o") + 1]
        assert Plan.from_json(cwd / out_file).summary() in out
    elif words[:2] == ["autoplan", "show"]:
        assert out.strip() == Plan.from_json(cwd / words[2]).summary()
    elif words[:2] == ["autoplan", "explain"]:
        assert "chosen" in out and "views, aliases and tuple items left out" in out
    elif words[:2] == ["autoplan", "diff"]:
        assert out.startswith("cost (ms)")  # two plans of one model and mesh: no warning
    elif "calibrate" in words:  # autoplan calibrate, or under torchrun: a profile that loads, links fitted if N > 1
        out_file = words[words.index("--out") + 1] if "--out" in words else "profile.json"
        assert resolve_profile(str(cwd / out_file)).name.startswith("calibrated") and f"wrote {out_file}" in out
        assert ("links: inside a node" in out) == (words[0] == "torchrun")
    elif "validate" in words:
        assert re.search(r"^rank agreement of predicted and measured order: Kendall tau [+-]\d", out, re.M), out
        assert ("waits on collectives: exposed" in out) == (words[0] == "torchrun"), out  # gloo ranks
    elif "--execute" in words:
        assert "losses match single-device" in out
    elif words[0] == "torchrun":
        assert re.search(r"^step \d+: local loss", out, re.M), out
    else:
        assert out.strip(), f"{command} printed nothing"


def _run_all(kinds: set[str], cwd: Path) -> list[str]:
    ran = []
    for command in COMMANDS:
        if kind(command) in kinds:
            check_output(command, run_command(command, cwd).stdout, cwd)
            ran.append(command)
    return ran


def test_readme_commands_run(tmp_path):
    """The main job and the ``autoplan`` commands, as the README spells them, in its order."""
    ran = _run_all({"run"}, tmp_path)
    assert "python examples/example_llama3.py" in ran and any(c.startswith("autoplan diff") for c in ran)


@pytest.mark.slow
def test_every_readme_command_that_runs_on_one_machine_runs(tmp_path):
    """The fast ones again (they write the plans the others read), then ``--execute``, the
    benchmarks and ``torchrun`` on this machine."""
    ran = _run_all({"run", "slow"}, tmp_path)
    assert any("--execute" in c for c in ran) and any(c.startswith("torchrun") for c in ran)
