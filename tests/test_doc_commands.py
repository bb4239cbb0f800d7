"""Every shell command in README.md and results/REPORT.md, run or validated; every documented `key=value`
override resolves in its config group.

Commands are read from fenced (bash/sh/console or unlabelled) and indented code blocks, and from inline
backticks that start like a command (`python -m mha2mla_exp ...`, `python -m mha2mla_exp.<module> ...`,
`python -m pytest ...`, `python scripts/...`, `sweeps/...sh`, `scripts/...sh`, `torchrun ...`). Python snippets
(```python) and other tools (`lm_eval ...`, covered by tests/test_mla_remote_code.py) are not shell commands here.
What each kind gets, the cheapest check that fails where the command would:

- `python -m mha2mla_exp [overrides]` (and `torchrun ... -m mha2mla_exp`): composed in-process with Hydra's compose
  API and validated (`runner.validate`, what every run does before loading a weight), a sweep cell by cell (its
  experiment's `hydra.sweeper` rows and params and the command's own `a,b,c` values, expanded as the sweeper does); plus
  the one input check a run makes after validation and before loading a weight: a fine-tune budget that would
  repeat a finite corpus (stages.training_rows). The runner's own `dry_run=true` skips that check, so it cannot be
  the check here. torchrun's `--nproc_per_node N` is validated as N processes (WORLD_SIZE). Nothing is trained:
  a full run is minutes to days.
- `python -m <module> ...`: the module run as `python -m` runs it (runpy, in-process), with `--help` appended to
  the documented arguments (`a|b` alternatives each, `...` dropped): the entry point imports, and its subcommands
  and positionals parse (argparse stops at `--help`, so an unknown flag is not caught).
- `python -m pytest ...`: collected (`--collect-only`), never run: running the suite from inside it would nest.
- `sweeps/*.sh`, `scripts/*.sh`: run by bash with `python`, `python3` and `torchrun` stubbed on PATH; every
  `mha2mla_exp` invocation the script makes is then checked as above. A script that invokes nothing fails.
- `pip install`: the pinned requirements are what this environment has, and `-e .[extra]` names extras that
  pyproject.toml declares (nothing is installed); `python3 -m venv` runs `--help`; `. <venv>/bin/activate` must
  name the venv the chain just created.

Hub-only inputs cannot be reached on CPU CI (no network, no AWS credentials): hub models and datasets are
validated offline as a run validates them (a note, not an error), python-edu's credential check is patched as in
tests/test_configs.py, and a hub model's corpus budget (its tokenizer is not here) is not checked.

To check the checker on edited docs: MHA2MLA_DOC_FILES=/tmp/copy/README.md:/tmp/copy/REPORT.md pytest <this file>.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
import tomllib
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import pytest
from test_configs import offline_longbench, options

from tests.compositions import composed
from tests.conftest import bf16_untimed

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
COMMAND_DOCS = (
    [Path(p) for p in os.environ["MHA2MLA_DOC_FILES"].split(os.pathsep)]
    if os.environ.get("MHA2MLA_DOC_FILES")
    else [ROOT / "README.md", ROOT / "results" / "REPORT.md"]
)
KEY_DOCS = [*COMMAND_DOCS, *sorted((ROOT / "docs").glob("*.md"))]

# ---------------------------------------------------------------------------------------------------------------
# reading commands out of markdown

SHELL_FENCES = {"", "bash", "sh", "shell", "console", "zsh"}
BLOCK_WORDS = {"python", "python3", "pip", "pip3", "torchrun", ".", "source", "bash"}  # a code-block line's first word
INLINE_COMMAND = re.compile(
    r"^(python3? -m (mha2mla_exp|pytest)\b|python3? scripts/|(\./)?(sweeps|scripts)/\S+\.sh\b|"
    r"torchrun\s)"
)
PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*$")  # DIR, K, N: stand-ins the reader replaces


@dataclass(frozen=True)
class DocCommand:
    source: str  # file:line of its first occurrence
    text: str

    @property
    def id(self) -> str:
        return f"{self.source} {self.text}"


def _is_block_command(line: str) -> bool:
    words = line.split()
    return bool(words) and (words[0] in BLOCK_WORDS or bool(re.match(r"(\./)?(sweeps|scripts)/\S+\.sh$", words[0])))


def code_blocks(text: str):
    """(line number, line, language) of fenced and indented code-block lines; the rest of the text with those
    lines blanked (so that inline spans are read from prose only)."""
    lines = text.splitlines()
    block, prose = [], []
    fence, lang, indented = None, None, False
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if fence is not None:
            if stripped.startswith(fence):
                fence = None
            else:
                block.append((number, line, lang))
            prose.append("")
            continue
        match = re.match(r"^\s*(```+|~~~+)\s*([\w+-]*)", line)
        if match:
            fence, lang, indented = match.group(1), match.group(2).lower(), False
            prose.append("")
            continue
        previous_blank = number == 1 or not lines[number - 2].strip()
        if line.startswith("    ") and stripped and (indented or previous_blank) and _is_block_command(stripped):
            indented = True  # an indented block of commands (README's "What you can type")
            block.append((number, line, "indented"))
            prose.append("")
            continue
        indented = indented and line.startswith("    ") and bool(stripped)
        prose.append(line)
    return block, "\n".join(prose)


def extract_commands(text: str, name: str = "doc") -> list[DocCommand]:
    """Every shell command of a markdown text, in order (backslash continuations joined)."""
    found = []
    block, prose = code_blocks(text)
    pending, start = "", None
    for number, line, lang in block:
        if lang not in SHELL_FENCES and lang != "indented":
            continue
        stripped = line.strip().removeprefix("$ ")
        if pending:
            stripped = pending + " " + stripped
        else:
            start = number
        if stripped.endswith("\\"):
            pending = stripped[:-1].rstrip()
            continue
        pending = ""
        if _is_block_command(stripped):
            found.append(DocCommand(f"{name}:{start}", stripped))
    for match in re.finditer(r"(?<!`)`([^`]+)`(?!`)", prose):
        span = " ".join(match.group(1).split())  # an inline span may wrap over lines
        if "\n\n" not in match.group(1) and INLINE_COMMAND.match(span):
            found.append(DocCommand(f"{name}:{prose.count(chr(10), 0, match.start()) + 1}", span))
    return found


def documented_commands() -> list[DocCommand]:
    seen, out = set(), []
    for path in COMMAND_DOCS:
        rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        for command in extract_commands(path.read_text(), str(rel)):
            if command.text not in seen:
                seen.add(command.text)
                out.append(command)
    return out


OVERRIDE = re.compile(r"^([a-z_][a-z0-9_]*(?:\.[A-Za-z0-9_]+)+)=(.*)$")


def documented_overrides() -> list[tuple[str, str, tuple[str, ...]]]:
    """(where, key, values) for every `group.key=value` written without `+` in a code span or code block:
    `key=a | b | c` documents each value."""
    out, seen = [], set()
    for path in KEY_DOCS:
        rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        text = path.read_text()
        block, prose = code_blocks(text)
        # a whole command is checked as a whole (test_documented_command); here the keys written on their own
        pieces = [
            (n, line)
            for n, line, lang in block
            if (lang in SHELL_FENCES or lang == "indented") and not _is_block_command(line.strip())
        ]
        spans = [
            (prose.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split()))
            for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", prose)
        ]
        pieces += [(n, span) for n, span in spans if not INLINE_COMMAND.match(span)]
        for number, piece in pieces:
            alternatives = re.fullmatch(r"([a-z_][a-z0-9_.]*\.[A-Za-z0-9_]+)=(\S+(?: \| \S+)+)", piece.strip())
            if alternatives:
                items = [(alternatives.group(1), tuple(v.strip() for v in alternatives.group(2).split("|")))]
            else:
                try:
                    tokens = shlex.split(piece, comments=True)
                except ValueError:  # prose with an apostrophe: no quoting to honour
                    tokens = piece.split()
                items = [(m.group(1), (m.group(2),)) for m in map(OVERRIDE.match, tokens) if m]
            for key, values in items:
                if (key, values) not in seen:
                    seen.add((key, values))
                    out.append((f"{rel}:{number}", key, values))
    return out


# ---------------------------------------------------------------------------------------------------------------
# checking them


class CommandFailed(AssertionError):
    pass


@contextlib.contextmanager
def hydra_conf():
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        yield
        return
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield


def compose(overrides, hydra: bool = False):
    """The session's memoized composition (tests/compositions.py): the docs repeat the experiments' jobs."""
    with hydra_conf():
        return composed(list(overrides), hydra)


def is_sweep(override: str) -> bool:
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    with hydra_conf():
        parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
        return parser.parse_override(override).is_sweep_override()


@contextlib.contextmanager
def world_size(n: int):
    old = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(n)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("WORLD_SIZE")
        else:
            os.environ["WORLD_SIZE"] = old


class Checker:
    """Runs the checks; memoizes cells and prepared corpora across commands (a sweep script repeats them)."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.placeholders = {"DIR": str(self._local_model_dir())}
        self.commands: dict = {}  # a command the docs give twice (README and REPORT) is checked once
        self.cells: dict = {}
        self.corpora: dict = {}

    def _local_model_dir(self) -> Path:
        """A folder for `model=local model.id=DIR`: a model's config.json is what validation reads."""
        from transformers import LlamaConfig

        folder = self.tmp / "local_model"
        LlamaConfig(
            vocab_size=97,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
        ).save_pretrained(folder)
        return folder

    # -- one documented line: `a && b && c`
    def check(self, text: str) -> list[str]:
        """Check one documented command line; return what was checked, raise CommandFailed where it would fail."""
        done, venv = [], None
        tokens = shlex.split(text, comments=True)
        parts = [list(g) for sep, g in itertools.groupby(tokens, lambda t: t in ("&&", ";")) if not sep]
        if not parts:
            raise CommandFailed(f"nothing to run in {text!r}")
        for argv in parts:
            if argv[:3] in (["python3", "-m", "venv"], ["python", "-m", "venv"]):
                venv = next(a for a in argv[3:] if not a.startswith("-"))
            if argv[0] in (".", "source"):
                if venv is None or argv[1:] != [f"{venv}/bin/activate"]:
                    raise CommandFailed(f"{' '.join(argv)!r} activates no venv this line created")
                done.append(f"activate {venv}")
                continue
            done += self.dispatch(argv)
        return done

    @staticmethod
    def _once(store: dict, key, check):
        """check() the first time `key` is met; its result, or its CommandFailed raised again, every time after."""
        if key not in store:
            try:
                store[key] = check()
            except CommandFailed as err:
                store[key] = err
        if isinstance(store[key], CommandFailed):
            raise store[key]
        return store[key]

    def dispatch(self, argv: list[str], world: int = 1) -> list[str]:
        return self._once(self.commands, (tuple(argv), world), lambda: self._dispatch(argv, world))

    def _dispatch(self, argv: list[str], world: int) -> list[str]:
        prog = Path(argv[0]).name
        if prog in ("python", "python3"):
            if argv[1:2] == ["-"]:
                return ["(a script on stdin: not checked)"]
            if argv[1:3] == ["-m", "mha2mla_exp"]:
                return self.hydra_app(argv[3:], world)
            if argv[1:3] == ["-m", "pytest"]:
                return self.pytest_collect(argv[3:])
            if argv[1] == "-m":
                return self.module_help(argv[2], argv[3:])
            if argv[1].endswith(".py"):
                return self.script_help(argv[1], argv[2:])
        if prog == "torchrun":
            return self.torchrun(argv[1:])
        if prog in ("pip", "pip3"):
            return self.pip(argv[1:])
        if argv[0].endswith(".sh"):
            return self.shell_script(argv[0], argv[1:])
        raise CommandFailed(f"no check for this kind of command: {' '.join(argv)!r}")

    # -- the Hydra app
    def hydra_app(self, args: list[str], world: int = 1) -> list[str]:
        multirun = any(a in ("-m", "--multirun") for a in args)
        flags = [a for a in args if a.startswith("-") and a not in ("-m", "--multirun")]
        if flags:
            raise CommandFailed(f"Hydra flags this test does not handle: {flags}")
        from mha2mla_exp.confutil import launch_arguments

        # the command line as __main__ hands it to Hydra (`experiment=NAME`, any name a run records under)
        overrides = launch_arguments([self._fill(a) for a in args if a not in ("-m", "--multirun")])
        for i, override in enumerate(overrides):  # `+cells/x=<cell>`: the reader picks one; check every choice
            key, _, value = override.partition("=")
            if re.fullmatch(r"<[\w-]+>", value):
                group = key.lstrip("+~")
                if not (CONF / group).is_dir():
                    raise CommandFailed(f"{override}: {group} is not a config group")
                done = []
                for option in options(group):
                    chosen = overrides[:i] + [f"{key}={option}"] + overrides[i + 1 :]
                    done += self.hydra_app(["-m"] * multirun + chosen, world)
                return [f"{value} = each of {len(options(group))} {group} options: " + "; ".join(done)]
        try:  # the sweep's own values (`rope=a,b`) are expanded below; the experiment's choices compose first
            cfg = compose([o for o in overrides if not (multirun and is_sweep(o))], hydra=True)
        except Exception as err:
            raise CommandFailed(f"composing {overrides}: {type(err).__name__}: {err}") from err
        from hydra.types import RunMode
        from hydra.utils import get_class

        mode = cfg.hydra.mode
        multirun = multirun or mode in (RunMode.MULTIRUN, "MULTIRUN")
        if mode in (RunMode.RUN, "RUN") and "hydra.mode=RUN" in overrides:
            multirun = False
        launcher = cfg.hydra.launcher
        get_class(launcher._target_)  # its plugin is installed
        if "submitit" in launcher._target_:
            world = max(world, int(launcher.get("tasks_per_node") or 1) * int(launcher.get("nodes") or 1))
        cells = self.sweep_cells(cfg, overrides) if multirun else [overrides]
        for cell in cells:
            self.cell(tuple(cell), world)
        return [f"{len(cells)} cell(s) validated" + (f" as {world} processes" if world > 1 else "")]

    def _fill(self, arg: str) -> str:
        key, eq, value = arg.partition("=")
        return f"{key}={self.placeholders[value]}" if eq and value in self.placeholders else arg

    @staticmethod
    def sweep_cells(cfg, overrides: list[str]) -> list[list[str]]:
        """The cells the sweeper would launch: the experiment's rows and params (hydra/sweeper: rows; Hydra's
        BasicSweeper has params only), then the command line."""
        from hydra.core.global_hydra import GlobalHydra
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from omegaconf import OmegaConf

        from hydra_plugins.rows_sweeper.rows_sweeper import grid, jobs

        if not cfg.hydra.sweeper._target_.endswith(("BasicSweeper", "RowsSweeper")):
            raise CommandFailed(f"sweeper {cfg.hydra.sweeper._target_} is not expanded by this test")
        sweeper = OmegaConf.to_container(cfg.hydra.sweeper, resolve=True)
        rows = grid(
            sweeper.get("params"), sweeper.get("rows"), sweeper.get("budget"), sweeper.get("at"), sweeper.get("only")
        )
        with hydra_conf():
            parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
            return jobs(rows, list(overrides), parser)

    def cell(self, overrides: tuple[str, ...], world: int) -> None:
        def check():
            try:
                self._check_cell(list(overrides), world)
            except Exception as err:
                raise CommandFailed(f"{' '.join(overrides)}: {type(err).__name__}: {err}") from err

        self._once(self.cells, (overrides, world), check)

    def _check_cell(self, overrides: list[str], world: int) -> None:
        from mha2mla_exp.runner import run_config, validate

        cfg = compose(overrides)
        with world_size(world):
            plan = validate(run_config(cfg), bf16_pays=bf16_untimed)
            if plan.training.fine_tune:
                self.budget(plan, world)

    def budget(self, plan, world: int) -> None:
        """What the run checks next, before any weight: the budget against a finite corpus (stages.training_rows)."""
        from dataclasses import asdict

        from mha2mla_exp import models
        from mha2mla_exp.data import prepare_data
        from mha2mla_exp.runner import stages
        from mha2mla_exp.runner.config import ConfigError

        config = plan.config
        source = config.train.data or config.data
        if source.source == "hub":
            return  # streamed: never repeats
        try:
            tokenizer = self._tokenizer(config.model)
        except OSError:
            if config.model.source == "hub":
                return  # a hub model's tokenizer is not here offline
            raise
        key = json.dumps([config.model.id, asdict(source)], sort_keys=True, default=str)
        if key not in self.corpora:
            real = models.load_model

            def no_teacher(*a, **k):
                raise _TeacherNeeded

            models.load_model = no_teacher  # text the teacher writes: only when it is cached or published
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    self.corpora[key] = prepare_data(source, tokenizer)
            except _TeacherNeeded:
                self.corpora[key] = None
            finally:
                models.load_model = real
        if self.corpora[key] is None:
            return
        try:
            stages.training_rows(config.train, plan.training.budget.tokens, self.corpora[key], config.seed)
        except ValueError as err:
            raise ConfigError(str(err)) from err

    @lru_cache(maxsize=None)
    def _tokenizer_for(self, model_json: str):
        from mha2mla_exp.confutil import typed_section
        from mha2mla_exp.models import load_tokenizer
        from mha2mla_exp.schema.sections import ModelConfig

        return load_tokenizer(typed_section(ModelConfig, json.loads(model_json), "model"))

    def _tokenizer(self, model):
        from dataclasses import asdict

        return self._tokenizer_for(json.dumps(asdict(model), sort_keys=True, default=str))

    def torchrun(self, args: list[str]) -> list[str]:
        world, i = 1, 0
        while i < len(args) and args[i] != "-m":
            arg = args[i]
            if arg in ("--nproc_per_node", "--nproc-per-node"):
                world, i = int(args[i + 1]), i + 2
                continue
            if arg.startswith(("--nproc_per_node=", "--nproc-per-node=")):
                world = int(arg.split("=", 1)[1])
            elif arg not in ("--standalone",) and not arg.startswith(("--nnodes", "--rdzv", "--master")):
                raise CommandFailed(f"torchrun option this test does not handle: {arg}")
            i += 1
        if args[i : i + 2] != ["-m", "mha2mla_exp"]:
            raise CommandFailed(f"torchrun runs {args[i : i + 2]}, not -m mha2mla_exp")
        return self.hydra_app(args[i + 2 :], world)

    # -- other entry points
    def module_help(self, module: str, args: list[str]) -> list[str]:
        args = [a for a in args if a != "..."]
        choices = [a.split("|") for a in args]
        done = []
        for combo in itertools.product(*choices):
            argv = [module, *combo, "--help"]
            saved = sys.argv
            sys.argv = list(argv)
            code = 0
            try:
                with warnings.catch_warnings(), contextlib.redirect_stdout(open(os.devnull, "w")):
                    warnings.simplefilter("ignore")  # runpy: the module was imported by its package already
                    runpy.run_module(module, run_name="__main__", alter_sys=True)
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
            except Exception as err:
                raise CommandFailed(f"python -m {' '.join(argv)}: {type(err).__name__}: {err}") from err
            finally:
                sys.argv = saved
            if code != 0:
                raise CommandFailed(f"python -m {' '.join(argv)} exited {code}")
            done.append(f"python -m {' '.join(argv)}")
        return done

    def script_help(self, script: str, args: list[str]) -> list[str]:
        run = subprocess.run(
            [sys.executable, script, *args, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        if run.returncode:
            raise CommandFailed(f"{script} {args} --help: exit {run.returncode}\n{run.stderr[-2000:]}")
        return [f"{script} --help"]

    def pytest_collect(self, args: list[str]) -> list[str]:
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if run.returncode:
            raise CommandFailed(f"pytest {args} --collect-only: exit {run.returncode}\n{run.stdout[-3000:]}")
        return [run.stdout.strip().splitlines()[-1]]

    def pip(self, args: list[str]) -> list[str]:
        from importlib.metadata import PackageNotFoundError, version

        from packaging.requirements import Requirement

        if args[:1] != ["install"]:
            raise CommandFailed(f"pip {args}: only `pip install` is checked")
        done, i, rest = [], 0, args[1:]
        while i < len(rest):
            arg = rest[i]
            if arg in ("--index-url", "--extra-index-url", "-i", "-f", "--find-links"):
                i += 2
                continue
            if arg == "-e":
                target, i = rest[i + 1], i + 2
                path, _, extras = target.partition("[")
                project = tomllib.loads((ROOT / path / "pyproject.toml").read_text())["project"]
                declared = set(project.get("optional-dependencies", {}))
                wanted = {e for e in extras.rstrip("]").split(",") if e}
                if wanted - declared:
                    raise CommandFailed(f"pip install -e {target}: extras {sorted(wanted - declared)} not declared")
                version(project["name"])  # installed
                done.append(f"-e {target}: {project['name']} with extras {sorted(wanted) or 'none'}")
                continue
            if arg.startswith("-"):
                i += 1
                continue
            req, i = Requirement(arg), i + 1
            try:
                have = version(req.name)
            except PackageNotFoundError as err:
                raise CommandFailed(f"{arg}: not installed here") from err
            if req.specifier and not req.specifier.contains(have, prereleases=True):
                raise CommandFailed(f"{arg}: this environment has {req.name} {have}")
            done.append(f"{arg}: {have}")
        return done

    def shell_script(self, script: str, args: list[str]) -> list[str]:
        path = ROOT / script
        if not path.is_file():
            raise CommandFailed(f"{script}: no such script")
        stubs, log = self.tmp / "stubs", self.tmp / f"calls-{abs(hash((script, *args)))}.jsonl"
        stubs.mkdir(exist_ok=True)
        for name in ("python", "python3", "torchrun"):
            stub = stubs / name
            stub.write_text(
                f"#!{sys.executable}\nimport json, os, sys\n"
                "with open(os.environ['DOC_COMMAND_LOG'], 'a') as f:\n"
                "    f.write(json.dumps([os.path.basename(sys.argv[0]), *sys.argv[1:]]) + '\\n')\n"
            )
            stub.chmod(0o755)
        log.unlink(missing_ok=True)
        env = os.environ | {"PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}", "DOC_COMMAND_LOG": str(log)}
        run = subprocess.run(["bash", str(path), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        if run.returncode:
            raise CommandFailed(f"{script} {args}: exit {run.returncode}\n{run.stderr[-2000:]}")
        calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        if not calls:
            raise CommandFailed(f"{script} {args} ran no command")
        done = []
        for call in calls:
            done += [f"{' '.join(call)[:80]}: {what}" for what in self.dispatch(call)]
        return done


class _TeacherNeeded(Exception):
    pass


@pytest.fixture(scope="module")
def checker(tmp_path_factory):
    from mha2mla_exp.data import sources

    with pytest.MonkeyPatch.context() as mp, hydra_conf():
        # the paper's mixture reads python-edu from S3: no AWS credentials on CI (as in tests/test_configs.py)
        mp.setattr(sources, "check_software_heritage_access", lambda where: None)
        yield Checker(tmp_path_factory.mktemp("doc_commands"))


COMMANDS = documented_commands()


def test_the_docs_have_commands():
    assert len(COMMANDS) >= 20, [c.text for c in COMMANDS]


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS, ids=[c.id for c in COMMANDS])
def test_documented_command(command, checker):
    done = checker.check(command.text)
    assert done, command.text


# ---------------------------------------------------------------------------------------------------------------
# documented overrides: every key resolves without `+`


def _composes_with(key: str, values: tuple[str, ...]):
    """The first group choice under which `key=value` composes (and, for a run key, validates) for every value."""
    from mha2mla_exp.runner import run_config, validate

    group = key.split(".")[0]
    choices = [[]]
    if key.startswith("hydra.launcher."):
        choices = [[f"hydra/launcher={o}"] for o in options("hydra/launcher")]
    elif (CONF / group).is_dir():
        choices += [[f"{group}={o}"] for o in options(group)]
    errors = []
    for choice in choices:
        try:
            for value in values:
                if PLACEHOLDER.match(value):
                    cfg = compose(choice, hydra=key.startswith("hydra."))
                    from omegaconf import OmegaConf

                    if OmegaConf.select(cfg, key, default=_MISSING) is _MISSING:
                        raise KeyError(f"{key} is not in the config")
                    continue
                cfg = compose([*choice, f"{key}={value}"], hydra=key.startswith("hydra."))
                if not key.startswith("hydra."):
                    validate(run_config(cfg), bf16_pays=bf16_untimed)
            return choice
        except Exception as err:
            errors.append(f"{choice or 'defaults'}: {type(err).__name__}: {str(err).splitlines()[0]}")
    raise AssertionError(f"{key}={'|'.join(values)} resolves under no choice of its group:\n" + "\n".join(errors))


_MISSING = object()
OVERRIDES = documented_overrides()


@pytest.mark.parametrize("where, key, values", OVERRIDES, ids=[f"{w} {k}={'|'.join(v)}" for w, k, v in OVERRIDES])
def test_documented_override_resolves(where, key, values, checker):
    _composes_with(key, values)


EVAL_KEYS = sorted({key for _, key, _ in OVERRIDES if key.startswith("eval.")} | {"eval.dtype"})


@pytest.mark.parametrize("option", options("eval"))
def test_every_eval_option_takes_the_documented_eval_keys(option, checker):
    """`eval=<any> eval.dtype=float32` (the issue's symptom: "Key 'dtype' is not in struct") and every other
    documented eval key, wherever its section is enabled, set without `+`."""
    from omegaconf import OmegaConf

    cfg = compose([f"eval={option}"])
    for key in EVAL_KEYS:
        parent = key.rsplit(".", 1)[0]
        section = OmegaConf.select(cfg, parent, default=None)
        if parent != "eval" and not (section is not None and section.get("enabled", True)):
            continue
        assert OmegaConf.select(cfg, key, default=_MISSING) is not _MISSING, f"conf/eval/{option}.yaml lacks {key}"
    from mha2mla_exp.runner import run_config, validate

    data = offline_longbench(cfg, checker.tmp)  # LongBench's data come from the hub: a folder in its format
    assert validate(run_config(compose([f"eval={option}", "eval.dtype=float32", *data]))).evaluation.dtype == "float32"


# ---------------------------------------------------------------------------------------------------------------
# the checker itself: what it reads, and that a broken command fails it

SAMPLE = """\
Intro `python -m mha2mla_exp rope=uniform
svd=split` and `python -m mha2mla_exp.aggregate results/runs` but not `conf/train/` nor `lm_eval --help`.

    python -m mha2mla_exp -m rope=high,low   # a comment
    sweeps/cpu_reproduction.sh cpu10x_table3

    mha2mla_exp/mla/   the method (a layout line, not a command)

```bash
torchrun --nproc_per_node 2 -m mha2mla_exp \\
  train=smoke
```

```python
python -m this_is_python_code
```
"""


def test_commands_are_read_from_blocks_and_inline_spans():
    got = [(c.source, c.text) for c in extract_commands(SAMPLE, "s")]
    assert got == [
        ("s:4", "python -m mha2mla_exp -m rope=high,low   # a comment"),
        ("s:5", "sweeps/cpu_reproduction.sh cpu10x_table3"),
        ("s:10", "torchrun --nproc_per_node 2 -m mha2mla_exp train=smoke"),
        ("s:1", "python -m mha2mla_exp rope=uniform svd=split"),
        ("s:2", "python -m mha2mla_exp.aggregate results/runs"),
    ]


@pytest.mark.parametrize(
    "broken",
    [
        "python -m mha2mla_exp eval=quick eval.no_such_key=1",  # not in struct
        "python -m mha2mla_exp rope.r=40",  # refused by validation
        "python -m mha2mla_exp -m rope=high,no_such_strategy",  # one bad cell of a sweep
        "python -m mha2mla_exp train.tokens=30000000",  # 30M tokens on 2.2M of SOTU
        "torchrun --nproc_per_node 3 -m mha2mla_exp train=paper data=smollm_corpus",  # 3 processes cannot split 64 rows
        "python -m mha2mla_exp.no_such_module",
        "sweeps/cpu_reproduction.sh no_such_experiment",  # runs nothing
        "pip install torch==0.0.1",
        "python3 -m venv .venv && . other/bin/activate",
    ],
)
def test_a_broken_command_fails_the_check(broken, checker):
    with pytest.raises(CommandFailed):
        checker.check(broken)
