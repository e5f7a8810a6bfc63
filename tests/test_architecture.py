"""The rules the code's shape promises, checked on the source itself.

- One installed name: every module is ``hookloop.*`` (``engine/`` and ``handlers/`` map to
  ``hookloop.engine`` and ``hookloop.handlers``), and nothing imports ``engine`` or ``handlers``
  as top-level names.
- ``hookloop.engine`` never imports ``hookloop.handlers``; handlers never import the composition root.
- No import cycles between the project's modules.
- Neither handlers nor the engine's modules reach into the trainer's private attributes (the trainer's
  own module and the ignite adapter it extends aside), nothing calls the trainer's ``_stop()`` from
  outside ``engine/trainer.py`` (a stop is a request on ``trainer.control``), and only the ignite
  adapter touches ignite's internals.
- Handlers do not import each other (the loggers' shared base and the run composition aside); a
  handler that is a package (``handlers/checkpoint/``) imports its own modules, and its rooms never
  import the handler module that wires them.
- The checkpoint format (``engine/checkpoint_format/``) is one package with no facade: its
  ``__init__`` hands no names on, its modules import only each other and the engine's errors, file
  helpers and thread setting (never a handler, never the trainer), and only the modules whose classes
  extend DCP's (``manifest``, ``safe_read``) import ``torch.distributed.checkpoint`` when imported,
  so ``import hookloop`` loads no DCP.
- The checkpoint wing's modules stay under :data:`MAX_LINES` lines each, the trainer under
  :data:`TRAINER_MAX_LINES`, every other module under :data:`PROJECT_MAX_LINES`.
- Only ``engine/files.py`` fsyncs: every durable or atomic write goes through it.
- The project requests skip / save / validate / stop / rollback on ``trainer.control`` and reads
  how a run ended there, never through names the state used to carry (the old compatibility
  views, the validate flag, handler-to-handler fields).
- The engine knows no shipped handler: ``engine/`` names none of their classes (code, comments or
  docstrings), never loads ``hookloop.handlers`` through ``importlib`` / ``__import__``, and its
  order table (``Priority``) names phases only; each shipped handler's place lives in its module.
- The learning rate has one writer: only the schedule (``engine/lr.py``) writes a parameter group's
  ``"lr"``, and nothing but the trainer sets an ``lr_scheduler`` (no handler replaces it).
- Step bodies (``engine/step_body.py``, ``engine/pipeline/``) see the trainer only through the
  ``StepContext`` they are handed: no trainer argument, no call back into the trainer's step.
  Validation runs through the body too: the validator never looks at the pipeline.
"""

from __future__ import annotations

import ast
import configparser
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IGNITE_ADAPTER = "hookloop.engine.ignite_adapter"
LR_WRITER = "hookloop.engine.lr"
# What holds a parameter group's settings: ``group``, ``pg``, ``g``, ``optimizer.param_groups[i]``.
PARAM_GROUP = re.compile(r"(^|[._])(groups?|pg|g)(\[[^\]]*\])?$")
IGNITE_PRIVATE = {
    "_event_handlers",
    "_init_iter",
    "_dataloader_iter",
    "_is_done",
    "_allowed_events",
    "_internal_run_generator",
    "_setup_dataloader_iter",
    "_handle_exception",
    "_fire_event",
    "_process_function",
    "_state_dict_user_keys",
    "_check_and_set_max_epochs",
    "_check_and_set_max_iters",
    "_need_to_sync",
    "_do_all_reduce",
    "_do_all_gather",
    "_do_all_gather_object",
    "_do_broadcast",
}
# Handler modules other handler modules may import: a shared base and the composition of a run.
SHARED_HANDLER_MODULES = {
    "hookloop.handlers.metric_logger",
    "hookloop.handlers.loggers",
    "hookloop.handlers.sections",
}
# Modules held to the size bound: the checkpoint wing (the handler package and the checkpoint format
# it reads and writes) and the file helpers.
MAX_LINES = 450
BOUNDED = (
    "handlers/checkpoint/*.py",
    "engine/checkpoint_format/*.py",
    "engine/files.py",
    "engine/rng.py",
)
CHECKPOINT_FORMAT = "hookloop.engine.checkpoint_format"
# What the format package may import besides its own modules: the engine's leaves.
FORMAT_MAY_IMPORT = {"hookloop.engine.errors", "hookloop.engine.files", "hookloop.engine.intra_op"}
# The format's modules whose classes extend DCP's: the only ones that load it when imported.
FORMAT_DCP_MODULES = {
    f"{CHECKPOINT_FORMAT}.manifest",
    f"{CHECKPOINT_FORMAT}.durable_files",
    f"{CHECKPOINT_FORMAT}.safe_read",
}
# The trainer: the loop and the step's tail; its rooms (run limits, start, end, error path, step
# decisions, handler registry, validation) live in their own modules.
TRAINER_MAX_LINES = 700
# Every other module.
PROJECT_MAX_LINES = 1100
FSYNC = re.compile(r"\bos\.fsync\(|^\s*def fsync_", re.M)
COMPOSERS = {
    "hookloop.handlers",
    "hookloop.handlers.run_config",
    "hookloop.handlers.loggers",
    "hookloop.handlers.plot",
    "hookloop.handlers.config_reference",
    "hookloop.handlers.order",
}


def package_dirs() -> dict[str, Path]:
    """Installed package name -> its folder, as setup.cfg's ``package_dir`` maps them."""
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    mapping = {}
    for line in cfg["options"]["package_dir"].strip().splitlines():
        name, _, folder = (part.strip() for part in line.partition("="))
        mapping[name] = REPO / folder
    return mapping


def modules() -> dict[str, Path]:
    """Every installed module name -> its source file."""
    found = {}
    for package, folder in package_dirs().items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *(parts[:-1] if parts[-1] == "__init__" else parts)))
            found.setdefault(name, path)
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Project modules ``name`` imports anywhere in its source (module level or inside functions),
    skipping ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    is_package = path.name == "__init__.py"

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            for alias in node.names:
                out.add(f"{mod}.{alias.name}")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in out if m in known and m != name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def test_the_package_maps_every_folder_under_hookloop():
    dirs = package_dirs()
    assert set(dirs) == {"hookloop", "hookloop.engine", "hookloop.handlers"}
    names = modules()
    assert all(name == "hookloop" or name.startswith("hookloop.") for name in names)
    for expected in (
        "hookloop.engine.trainer",
        "hookloop.handlers.checkpoint",
        "hookloop.cli",
        "hookloop.train",
    ):
        assert expected in names


def test_nothing_imports_engine_or_handlers_as_top_level_names():
    """Code, tests, examples, benchmarks and docs snippets import ``hookloop``: a bare ``engine``
    or ``handlers`` import would work only from the repository root (or load a second copy)."""
    bare = re.compile(r"^\s*(?:from|import)\s+(engine|handlers|examples)\b", re.M)
    offenders = []
    for folder in ("src", "engine", "handlers", "tests", "examples", "benchmarks", "docs"):
        for path in sorted((REPO / folder).rglob("*")):
            if path.suffix in (".py", ".md", ".sh") and "results" not in path.parts:
                for m in bare.finditer(path.read_text()):
                    offenders.append(f"{path.relative_to(REPO)}: {m.group(0).strip()}")
    for m in bare.finditer((REPO / "README.md").read_text()):
        offenders.append(f"README.md: {m.group(0).strip()}")
    assert offenders == []


def test_engine_never_imports_handlers_or_the_composition_root():
    graph_ = graph()
    offenders = {
        name: sorted(d for d in deps if d.startswith(("hookloop.handlers", "hookloop.train", "hookloop.cli")))
        for name, deps in graph_.items()
        if name.startswith("hookloop.engine")
    }
    offenders.update(
        {
            name: sorted(d for d in deps if d.startswith(("hookloop.train", "hookloop.cli")))
            for name, deps in graph_.items()
            if name.startswith("hookloop.handlers")
        }
    )
    assert {k: v for k, v in offenders.items() if v} == {}
    for name, path in modules().items():
        if name.startswith("hookloop.engine"):
            source = path.read_text()
            assert 'import_module("hookloop.handlers' not in source, name


def test_no_import_cycles():
    g = graph()
    # a package importing its own submodules is how packages export names; not a cycle of concepts
    edges = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in g.items()}
    cycles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(edges.get(m, ())):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d) :] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert cycles == []


def _private_accesses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in ("trainer", "engine"):
            found.append(f"{path.name}:{node.lineno} {owner.id}.{node.attr}")
        elif (
            isinstance(owner, ast.Attribute)
            and isinstance(owner.value, ast.Name)
            and owner.value.id == "self"
            and owner.attr in ("trainer", "_trainer", "engine")
        ):
            found.append(f"{path.name}:{node.lineno} self.{owner.attr}.{node.attr}")
    return found


# The trainer's own rooms: its module and the ignite adapter it extends.
TRAINER_ROOMS = {REPO / "engine" / "trainer.py", REPO / "engine" / "ignite_adapter.py"}


def test_handlers_and_the_engine_never_touch_private_trainer_attributes():
    paths = [*(REPO / "handlers").rglob("*.py"), *(REPO / "engine").rglob("*.py")]
    outside = [path for path in sorted(paths) if path not in TRAINER_ROOMS]
    offenders = [hit for path in outside for hit in _private_accesses(path)]
    assert offenders == []


def _outside_stops(path: Path) -> list[str]:
    """Calls of ``<something other than self>._stop()`` in one file: the trainer's stop, called
    from outside it."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "_stop":
            owner = node.func.value
            if not (isinstance(owner, ast.Name) and owner.id == "self"):
                found.append(f"{path.name}:{node.lineno} {ast.unparse(node.func)}()")
    return found


def test_nothing_calls_the_trainers_stop_from_outside_the_trainer():
    paths = [p for folder in ("engine", "handlers", "src", "examples") for p in (REPO / folder).rglob("*.py")]
    trainer = REPO / "engine" / "trainer.py"
    offenders = [hit for path in sorted(paths) if path != trainer for hit in _outside_stops(path)]
    assert offenders == []


def test_only_the_adapter_touches_ignite_internals():
    offenders = []
    for name, path in modules().items():
        if name == IGNITE_ADAPTER:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in IGNITE_PRIVATE:
                offenders.append(f"{name}:{node.lineno} .{node.attr}")
            if isinstance(node, ast.FunctionDef) and node.name in IGNITE_PRIVATE:
                offenders.append(f"{name}:{node.lineno} def {node.name}")
    assert offenders == []


def _handler_of(module: str) -> str:
    """The handler a module belongs to: ``hookloop.handlers.<name>`` (a module or a package)."""
    return ".".join(module.split(".")[:3])


def test_handlers_do_not_import_each_other():
    offenders = {}
    for name, deps in graph().items():
        if not name.startswith("hookloop.handlers.") or name in COMPOSERS:
            continue
        own = _handler_of(name)
        bad = sorted(
            d
            for d in deps
            if d.startswith("hookloop.handlers.")
            and d not in SHARED_HANDLER_MODULES
            and _handler_of(d) != own
        )
        bad = [d for d in bad if not any(d.startswith(s + ".") for s in SHARED_HANDLER_MODULES)]
        if bad:
            offenders[name] = bad
    assert offenders == {}


def _trainer_references(node: ast.AST, where: str) -> list[str]:
    """Places under ``node`` that name a trainer: a ``trainer`` name or argument, a ``_trainer``
    attribute, or the trainer's step (``finish_step``, ``_finish_step``)."""
    found = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id == "trainer":
            found.append(f"{where}:{sub.lineno} {sub.id}")
        elif isinstance(sub, ast.arg) and sub.arg == "trainer":
            found.append(f"{where}:{sub.lineno} argument {sub.arg}")
        elif isinstance(sub, ast.Attribute) and sub.attr in ("_trainer", "finish_step", "_finish_step"):
            found.append(f"{where}:{sub.lineno} .{sub.attr}")
    return found


def test_step_bodies_see_the_trainer_only_through_their_context():
    offenders = []
    for path in sorted((REPO / "engine" / "pipeline").glob("*.py")):
        offenders += _trainer_references(ast.parse(path.read_text()), f"pipeline/{path.name}")
    for node in ast.parse((REPO / "engine" / "step_body.py").read_text()).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name != "StepContext":
            offenders += _trainer_references(node, f"step_body.py {node.name}")
    assert offenders == []


def test_the_validator_has_no_pipeline_case():
    tree = ast.parse((REPO / "engine" / "validation.py").read_text())
    names = {"pipeline", "has_last", "pp_rank", "dp_mesh"}  # the body says what validation needs
    hits = [
        f"{n.lineno} .{n.attr}" for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in names
    ]
    assert hits == []


# What is asked and read on ``trainer.control`` (or ``trainer.save_policy``) only: names the state
# used to carry as views onto the control point, its validate flag, and fields handlers used to pass
# messages to each other.
STATE_CONTROL_NAMES = {
    "skip_step",
    "should_checkpoint",
    "should_stop",
    "should_validate",
    "stop_reason",
    "exit_code",
    "request_stop",
    "hold_saves",
    "protected_step",
    "known_good_step",
    "hold_checkpoints",
    "rollback_target_step",
    "rollback_keep_data_position",
    "initial_checkpoint_requested",
}


def _state_control_uses(path: Path) -> list[str]:
    """``<...>state.<name>`` (or a ``getattr`` of one) for the control's names, in one file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in STATE_CONTROL_NAMES:
            owner = node.value
            owner_name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
            if owner_name == "state":
                found.append(f"{path.name}:{node.lineno} state.{node.attr}")
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("getattr", "setattr", "hasattr"):
            names = [a.value for a in node.args[1:2] if isinstance(a, ast.Constant)]
            if names and names[0] in STATE_CONTROL_NAMES:
                found.append(f"{path.name}:{node.lineno} {node.func.id}(..., {names[0]!r})")
    return found


def test_the_project_asks_through_the_control_point_not_the_state():
    paths = [
        p
        for folder in ("handlers", "engine", "src", "examples", "benchmarks")
        for p in (REPO / folder).rglob("*.py")
    ]
    offenders = [hit for path in sorted(paths) for hit in _state_control_uses(path)]
    assert offenders == []


def _lr_writes(path: Path) -> list[str]:
    """Where a module writes a parameter group's rate (``g["lr"] = ...``, ``g["lr"] *= ...``,
    ``g.update({"lr": ...})``, ``g.update(lr=...)``) or sets an ``lr_scheduler`` other than its own."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in [t for top in targets for t in ast.walk(top)]:
            key = getattr(getattr(target, "slice", None), "value", None)
            if key == "lr" and PARAM_GROUP.search(ast.unparse(target.value)):
                found.append(f"{path.name}:{node.lineno} [{ast.unparse(target.slice)}] =")
            owner = getattr(target, "value", None)
            if getattr(target, "attr", "") == "lr_scheduler" and getattr(owner, "id", "") != "self":
                found.append(f"{path.name}:{node.lineno} .lr_scheduler =")
        method = getattr(node, "func", None)
        if getattr(method, "attr", "") in ("update", "setdefault") and PARAM_GROUP.search(
            ast.unparse(method.value)
        ):
            keys = [getattr(k, "value", None) for a in node.args if isinstance(a, ast.Dict) for k in a.keys]
            keys += [a.value for a in node.args[:1] if isinstance(a, ast.Constant)]
            if "lr" in keys + [k.arg for k in node.keywords]:
                found.append(f"{path.name}:{node.lineno} .{node.func.attr}(lr)")
    return found


def test_only_the_schedule_writes_the_learning_rate():
    offenders = [hit for name, path in modules().items() if name != LR_WRITER for hit in _lr_writes(path)]
    assert offenders == []
    assert _lr_writes(modules()[LR_WRITER])  # the schedule itself writes it


def test_the_checks_see_what_they_look_for(tmp_path):
    # The scanners must find a planted violation, or the tests above prove nothing.
    planted = tmp_path / "planted.py"
    planted.write_text(
        "def f(trainer, self):\n    trainer._init_iter = 1\n    return self.trainer._stateful\n"
    )
    assert len(_private_accesses(planted)) == 2
    stops = tmp_path / "stops.py"
    stops.write_text(
        "def f(trainer, self):\n    trainer._stop()\n    self.trainer._stop()\n    self._stop()\n"
    )  # noqa: E501
    assert len(_outside_stops(stops)) == 2
    asks = tmp_path / "asks.py"
    asks.write_text(
        "def f(trainer, state):\n    trainer.state.skip_step = True\n    state.request_stop('x')\n"
        "    getattr(state, 'rollback_keep_data_position', False)\n    trainer.control.request_skip()\n"
    )
    assert len(_state_control_uses(asks)) == 3
    body = "def run_step(self, microbatches, trainer):\n    return self._trainer.finish_step(1)\n"
    assert len(_trainer_references(ast.parse(body), "planted")) == 3
    pkg = tmp_path / "engine"
    pkg.mkdir()
    (pkg / "x.py").write_text("def g():\n    from hookloop.handlers.nan_detector import NaNDetector\n")
    assert imports_of("hookloop.engine.x", pkg / "x.py", {"hookloop.handlers.nan_detector"}) == {
        "hookloop.handlers.nan_detector"
    }
    # a module of a handler package is that handler's; another handler's module is not
    assert _handler_of("hookloop.handlers.checkpoint.writer") == _handler_of("hookloop.handlers.checkpoint")
    assert _handler_of("hookloop.handlers.checkpoint.store") != _handler_of("hookloop.handlers.nan_detector")
    assert len(FSYNC.findall("def fsync_dir(p):\n    os.fsync(fd)\n")) == 2
    rates = tmp_path / "rates.py"
    rates.write_text(
        "def f(trainer, group, groups):\n    group['lr'] = 1.0\n    groups[0]['lr'] *= 0.5\n"
        "    group.update({'lr': 2.0})\n    group.update(lr=3.0)\n    trainer.lr_scheduler = None\n"
        "    a, group['lr'] = 1, 2\n    self.lr_scheduler = None\n    group['momentum'] = 0.9\n"
        "    metrics['lr'] = 1.0\n    metrics.update(lr=1.0)\n"
    )
    assert len(_lr_writes(rates)) == 6


def test_the_checkpoint_rooms_never_import_the_handler_that_wires_them():
    """Each room gets its collaborators passed in; none reaches back to the handler object."""
    handler = "hookloop.handlers.checkpoint.handler"
    offenders = {
        name: sorted(d for d in deps if d == handler or d.startswith(handler + "."))
        for name, deps in graph().items()
        if name.startswith("hookloop.handlers.checkpoint.") and name != handler
    }
    assert {k: v for k, v in offenders.items() if v} == {}
    assert handler in graph()["hookloop.handlers.checkpoint"], "the package exports the handler"


def test_the_bounded_modules_stay_under_the_line_limit():
    sizes = {
        str(path.relative_to(REPO)): len(path.read_text().splitlines())
        for pattern in BOUNDED
        for path in sorted(REPO.glob(pattern))
    }
    assert len(sizes) >= 10, sizes  # the patterns still find the wing
    assert {path: n for path, n in sizes.items() if n > MAX_LINES} == {}


def test_the_trainer_stays_under_its_bound():
    n = len((REPO / "engine" / "trainer.py").read_text().splitlines())
    assert n <= TRAINER_MAX_LINES, f"engine/trainer.py has {n} lines; give a coherent part its own module"


def test_no_module_outgrows_the_project_bound():
    sizes = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    assert len(sizes) > 50, sizes
    assert {name: n for name, n in sizes.items() if n > PROJECT_MAX_LINES} == {}


def test_only_the_file_helpers_fsync():
    """Atomic and durable writes have one home (``engine/files.py``): no other module calls fsync or
    defines its own fsync helper."""
    call = FSYNC
    offenders = []
    for name, path in modules().items():
        if name == "hookloop.engine.files":
            continue
        offenders += [
            f"{name}:{path.read_text()[: m.start()].count(chr(10)) + 1}"
            for m in call.finditer(path.read_text())
        ]
    assert offenders == []


# Names of handler classes that are ordinary words the engine uses for its own concepts: the
# curriculum's ``Phase`` (the engine's order table has phases of a step too).
GENERIC_CLASS_NAMES = {"Phase"}


def _class_names(folder: Path) -> set[str]:
    names = set()
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                names.add(node.name)
    return names


def shipped_class_names() -> set[str]:
    """Every public class defined in ``handlers/``, by parsing the source (not importing it), less
    the ones that share a name with an engine class."""
    return _class_names(REPO / "handlers") - _class_names(REPO / "engine") - GENERIC_CLASS_NAMES


def _engine_mentions(names: set[str], folder: Path) -> list[str]:
    pattern = re.compile(r"\b(" + "|".join(sorted(map(re.escape, names), key=len, reverse=True)) + r")\b")
    hits = []
    for path in sorted(folder.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for m in pattern.finditer(line):
                hits.append(f"{path.relative_to(folder.parent)}:{number} {m.group(1)}")
    return hits


def _dynamic_handler_imports(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = ast.unparse(node.func)
        if func.split(".")[-1] not in ("import_module", "__import__"):
            continue
        args = " ".join(ast.unparse(a) for a in node.args)
        if "handlers" in args:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_engine_names_no_shipped_handler():
    names = shipped_class_names()
    assert {"AsyncCheckpointer", "NaNDetector", "StepScheduler", "RunConfig", "MetricLogger"} <= names
    assert _engine_mentions(names, REPO / "engine") == []


def test_the_engine_never_loads_handlers_dynamically():
    offenders = []
    for name, path in modules().items():
        if name.startswith("hookloop.engine"):
            offenders += [f"{name}:{hit}" for hit in _dynamic_handler_imports(path.read_text())]
    assert offenders == []


def test_the_engine_order_table_names_phases_only():
    """Each shipped handler's place is defined in its own module, from a phase; the engine's table
    holds the phases and the trainer's own places, none of them a shipped handler's name."""
    from hookloop.engine import Priority
    from hookloop.handlers import Places

    phases = {"ENGINE_FIRST", "CLOCK", "RESTORE", "OBSERVE", "VALIDATION", "DECIDE", "ACT", "DEFAULT",
              "RECORD", "CLEANUP", "ENGINE_LAST"}  # fmt: skip
    assert {k for k in vars(Priority) if not k.startswith("_")} == phases
    shipped = {k for k in vars(Places) if not k.startswith("_")}
    assert shipped and not shipped & phases
    defined_in_modules = set()
    for path in sorted((REPO / "handlers").rglob("*.py")):  # a handler package's modules too
        if path.name == "order.py":
            continue
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign) and "Priority." in ast.unparse(node.value):
                defined_in_modules |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    assert shipped <= defined_in_modules  # every place in the table comes from its handler's module


def test_the_engine_checks_find_planted_mentions(tmp_path):
    pkg = tmp_path / "engine"
    pkg.mkdir()
    planted = '"""Run before the NaNDetector."""\nX = 1  # see AsyncCheckpointer\nPhases = 2\n'
    (pkg / "x.py").write_text(planted)
    assert len(_engine_mentions({"NaNDetector", "AsyncCheckpointer", "Phase"}, pkg)) == 2
    source = (
        'import importlib\nimportlib.import_module("hookloop.handlers")\n__import__("hookloop.handlers.x")\n'
    )
    assert len(_dynamic_handler_imports(source)) == 2
    assert _dynamic_handler_imports('importlib.import_module("hookloop.engine.x")\n') == []


def test_the_checkpoint_format_is_one_package_without_a_facade():
    """Each part of the format is imported by its own module name: the package hands nothing on."""
    path = modules()[CHECKPOINT_FORMAT]
    assert path == REPO / "engine" / "checkpoint_format" / "__init__.py"
    tree = ast.parse(path.read_text())
    assert [ast.unparse(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))] == []
    assert {
        "errors",
        "directory",
        "manifest",
        "safe_read",
        "dcp_pickles",
        "pickle_bounds",
        "state_codec",
    } <= {name.rsplit(".", 1)[1] for name in modules() if name.startswith(CHECKPOINT_FORMAT + ".")}


def test_the_checkpoint_format_imports_no_handler_and_no_trainer():
    offenders = {
        name: sorted(d for d in deps if not d.startswith(CHECKPOINT_FORMAT) and d not in FORMAT_MAY_IMPORT)
        for name, deps in graph().items()
        if name == CHECKPOINT_FORMAT or name.startswith(CHECKPOINT_FORMAT + ".")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def _module_level_dcp_imports(path: Path) -> list[str]:
    """``torch.distributed.checkpoint`` imports at a module's top level (not inside a function)."""
    found = []
    for node in ast.parse(path.read_text()).body:
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        found += [f"{node.lineno}: {n}" for n in names if n.startswith("torch.distributed.checkpoint")]
    return found


def test_only_the_formats_dcp_classes_load_dcp_when_imported():
    offenders = {
        name: hits
        for name, path in modules().items()
        if name.startswith("hookloop.engine") and name not in FORMAT_DCP_MODULES
        for hits in [_module_level_dcp_imports(path)]
        if hits
    }
    assert offenders == {}
    assert all(_module_level_dcp_imports(modules()[name]) for name in FORMAT_DCP_MODULES)


def test_importing_hookloop_loads_no_distributed_checkpoint(tmp_path):
    """``import hookloop`` (the engine) stays free of ``torch.distributed.checkpoint``: the
    checkpoint handler loads it when it is imported, to save and load."""
    code = (
        "import sys, hookloop\n"
        "print(sorted(m for m in sys.modules if m.startswith('torch.distributed.checkpoint')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"import hookloop loaded: {out.stdout.strip()}"
