"""smolctl subcommands, one module each: NAME, HELP, add_arguments(parser), run(args, stub) -> exit code."""

from types import ModuleType

from . import (
    checkpoint,
    cp,
    create,
    exec,
    fork,
    image,
    info,
    logs,
    ls,
    results,
    rm,
    run,
    run_task,
    snapshot,
    verify,
)

COMMANDS: tuple[ModuleType, ...] = (create, ls, exec, cp, verify, rm, run, results, logs, snapshot, fork, checkpoint,
                                    image, run_task, info)

__all__ = ["COMMANDS"]
