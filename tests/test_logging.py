"""Logging habits (no engine): a library in the user's process, visible in vLLM's.

* importing eagle3_compat adds a NullHandler to the ``eagle3_compat`` logger
  and nothing else; records propagate to the application's handlers;
* ``EAGLE3_COMPAT_LOG_LEVEL`` / ``EAGLE3_COMPAT_DEBUG``, when set, are the
  ``eagle3_compat`` logger's level;
* in a vLLM-owned process, :func:`attach_to_vllm_logging` hands our records to
  the ``vllm`` logger's handler (vLLM's configuration simulated with plain
  ``logging``), at our level, unless the root logger has handlers;
* the command line (an application) shows our INFO lines on stderr.

Fresh interpreters where the process's logging state matters.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest

from eagle3_compat.logs import get_logger

ENV_VARS = ("EAGLE3_COMPAT_LOG_LEVEL", "EAGLE3_COMPAT_DEBUG")


def _fresh(code: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, env={**base, **env})
    assert proc.returncode == 0, proc.stderr
    return proc


def test_library_import_adds_only_a_null_handler_and_propagates():
    proc = _fresh(
        """
        import logging, sys
        root = logging.getLogger()
        before = list(root.handlers), root.level
        import eagle3_compat
        ours = logging.getLogger("eagle3_compat")
        print("on package import:", [type(h).__name__ for h in ours.handlers])
        import eagle3_compat.dataset
        from eagle3_compat.logs import get_logger
        print("root unchanged:", (list(root.handlers), root.level) == before)
        print("handlers:", [type(h).__name__ for h in ours.handlers])
        print("propagate:", ours.propagate, "level:", ours.level)
        get_logger("eagle3_compat.dataset").warning("unconfigured warning")  # application configured nothing
        logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="APP %(levelname)s %(name)s: %(message)s")
        get_logger("eagle3_compat.dataset").info("to the application")
        """
    )
    out = proc.stdout.splitlines()
    assert "root unchanged: True" in out
    assert "on package import: ['NullHandler']" in out
    assert "handlers: ['NullHandler']" in out
    assert "propagate: True level: 0" in out
    assert "APP INFO eagle3_compat.dataset: to the application" in out
    # nothing of ours on stderr: no handler of our own, and the NullHandler
    # keeps Python's last resort quiet for an application that chose nothing
    assert proc.stderr == ""


def test_application_handlers_receive_records_in_process(caplog):
    """The application's root handler and pytest's caplog both get our records."""
    got: list[logging.LogRecord] = []

    class AppHandler(logging.Handler):
        def emit(self, record):
            got.append(record)

    root = logging.getLogger()
    app = AppHandler()
    root.addHandler(app)
    try:
        with caplog.at_level(logging.INFO):
            get_logger("eagle3_compat.generator").warning("truncating, as an example")
    finally:
        root.removeHandler(app)
    assert [r.getMessage() for r in got if r.name == "eagle3_compat.generator"] == ["truncating, as an example"]
    assert "truncating, as an example" in caplog.text


LEVELS = """
    import logging, sys
    logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="APP %(levelname)s %(message)s")
    import eagle3_compat
    from eagle3_compat.logs import get_logger
    log = get_logger("eagle3_compat.worker")
    print("level", logging.getLogger("eagle3_compat").level)
    log.debug("d"); log.info("i"); log.warning("w"); log.error("e")
    """


@pytest.mark.parametrize(
    ("env", "level", "shown"),
    [
        ({}, 0, "WE"),  # unset: the application's level (root WARNING)
        ({"EAGLE3_COMPAT_DEBUG": "1"}, logging.DEBUG, "DIWE"),
        ({"EAGLE3_COMPAT_DEBUG": "0"}, 0, "WE"),
        ({"EAGLE3_COMPAT_LOG_LEVEL": "error"}, logging.ERROR, "E"),
        ({"EAGLE3_COMPAT_LOG_LEVEL": "INFO"}, logging.INFO, "IWE"),
        ({"EAGLE3_COMPAT_LOG_LEVEL": "ERROR", "EAGLE3_COMPAT_DEBUG": "1"}, logging.DEBUG, "DIWE"),
    ],
    ids=["unset", "debug", "debug-0", "level-error", "level-info", "debug-wins"],
)
def test_environment_variables_set_our_level_in_the_users_process(env, level, shown):
    out = _fresh(LEVELS, **env).stdout.splitlines()
    assert out[0] == f"level {level}"
    assert "".join(ln.split()[1][0] for ln in out[1:]) == shown, out


VLLM_PROCESS = """
    import logging, sys
    # vLLM's own configuration of its processes (vllm/logger.py): a handler on
    # "vllm" at VLLM_LOGGING_LEVEL, propagate False, nothing on the root logger.
    vllm = logging.getLogger("vllm")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("VLLM %(levelname)s [%(filename)s] %(name)s: %(message)s"))
    handler.setLevel(logging.WARNING)
    vllm.addHandler(handler)
    vllm.setLevel(logging.WARNING)
    vllm.propagate = False

    import eagle3_compat
    from eagle3_compat.logs import attach_to_vllm_logging, get_logger
    log = get_logger("eagle3_compat.worker")
    log.info("before attach")
    attach_to_vllm_logging()
    attach_to_vllm_logging()  # idempotent
    log.debug("debug line")
    log.info("info line")
    log.warning("warning line")
    logging.getLogger("vllm.engine").warning("vllm's own")
    {after}
    """


@pytest.mark.parametrize(
    ("env", "shown"),
    [
        ({}, ["INFO info line", "WARNING warning line"]),  # default INFO, whatever vLLM's level
        ({"EAGLE3_COMPAT_DEBUG": "1"}, ["DEBUG debug line", "INFO info line", "WARNING warning line"]),
        ({"EAGLE3_COMPAT_LOG_LEVEL": "WARNING"}, ["WARNING warning line"]),
    ],
    ids=["default", "debug", "warning"],
)
def test_attached_records_go_through_vllms_handler(env, shown):
    proc = _fresh(VLLM_PROCESS.format(after=""), **env)
    ours = [ln for ln in proc.stdout.splitlines() if "eagle3_compat.worker" in ln]
    assert ours == [f"VLLM {level} [<string>] eagle3_compat.worker: {msg} line"
                    for level, msg in (s.split()[:2] for s in shown)]
    assert "VLLM WARNING [<string>] vllm.engine: vllm's own" in proc.stdout  # vLLM's untouched
    assert proc.stderr == ""


def test_attached_records_go_to_the_root_logger_where_it_has_handlers():
    """A spawned process that re-imported a user script configuring logging
    (or a forked one): records propagate there, not twice."""
    after = (
        'logging.basicConfig(stream=sys.stdout, format="ROOT %(name)s: %(message)s")\n'
        '    log.info("rooted")'
    )
    out = _fresh(VLLM_PROCESS.format(after=after)).stdout.splitlines()
    assert [ln for ln in out if "rooted" in ln] == ["ROOT eagle3_compat.worker: rooted"]


def test_attached_without_a_vllm_handler_falls_back_to_the_last_resort():
    """``VLLM_CONFIGURE_LOGGING=0``: no handler anywhere; warnings still show, as without us."""
    proc = _fresh(
        """
        import logging
        from eagle3_compat.logs import attach_to_vllm_logging, get_logger
        attach_to_vllm_logging()
        get_logger("eagle3_compat.worker").info("quiet")
        get_logger("eagle3_compat.worker").warning("loud")
        """
    )
    assert proc.stderr.splitlines() == ["loud"]


def test_command_line_shows_our_info_lines_and_not_other_libraries():
    """``eagle3-compat`` configures logging for itself (a sub-command stands in
    for ``generate``, whose lines come from the generator)."""
    proc = _fresh(
        """
        import logging, os
        import eagle3_compat.__main__ as cli
        from eagle3_compat.logs import get_logger

        def command(_args):
            get_logger("eagle3_compat.generator").info("capture ready")
            get_logger("eagle3_compat.generator").debug("a step")
            logging.getLogger("some_library").info("chatter")
            logging.getLogger("some_library").warning("a warning")
            return 0

        cli._status = command
        print(cli.main(["status"]), os.getpid())
        """
    )
    rc, pid = proc.stdout.split()
    assert rc == "0"
    assert proc.stderr.splitlines() == [
        f"INFO [{pid}] eagle3_compat.generator: capture ready",
        f"WARNING [{pid}] some_library: a warning",
    ]
