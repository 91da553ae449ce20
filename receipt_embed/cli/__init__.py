"""The ``receipt-embed`` command line: a thin Click layer over library functions.

Each subcommand lives in its own module and is imported only when it runs, so
``receipt-embed --help`` does not pay for torch.
"""

from __future__ import annotations

import errno
import importlib
import io
import os
import sys
import warnings

import click

from receipt_embed.cli.options import GivenPath
from receipt_embed.display import printable, shortened
from receipt_embed.errors import BadInput
from receipt_embed.version import __version__

_debug = False  # set by --debug: internal errors show their traceback
_console = False  # set by run(): this process is the command line itself, not a test calling main()
_reader_gone = False  # set when standard output is a pipe whose reader closed it (`| head`)
CLOSED_PIPE_EXIT = 141  # what a shell reports for a process ended by SIGPIPE, as `yes | head` leaves `yes`

# command name -> "module:attribute"; help text is kept here so --help needs no import.
COMMANDS: dict[str, tuple[str, str]] = {
    "ingest": ("receipt_embed.cli.ingest:ingest", "Check captures and write a dataset dir."),
    "make-samples": (
        "receipt_embed.cli.make_samples:make_samples",
        "Render synthetic receipts captured by simulated devices.",
    ),
    "train": ("receipt_embed.cli.train:train", "Train an encoder on a dataset dir (contrastive)."),
    "plugins": ("receipt_embed.cli.plugins:plugins", "List plugins and the components they provide."),
    "config": ("receipt_embed.cli.config:config", "Print the resolved configuration."),
    "demo": ("receipt_embed.cli.demo:demo", "Run the whole pipeline on the bundled data_samples/."),
    "index": ("receipt_embed.cli.index:index", "Embed captures into a FAISS index dir."),
    "index-merge": (
        "receipt_embed.cli.index:index_merge",
        "Join the shard dirs of `index --shard` into one index dir.",
    ),
    "search": ("receipt_embed.cli.search:search", "Find a receipt's other captures, or all near-duplicate pairs."),
    "calibrate": (
        "receipt_embed.cli.calibrate:calibrate",
        "Pick duplicate thresholds that reach a target precision on a labelled index.",
    ),
    "audit-shortcuts": (
        "receipt_embed.cli.audit:audit_shortcuts",
        "Audit an index: retrieval, and clustering by device or other metadata.",
    ),
}


def _to_devnull(stream) -> None:
    """Point ``stream``'s file at /dev/null: what is still buffered for a pipe or disk that failed
    would fail again at every later write and at interpreter exit."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
    except (OSError, ValueError):
        pass


class StdoutFailed(Exception):
    """Writing to standard output failed (a full disk, an I/O error): not an input error of a command,
    so no command's ``except OSError`` turns it into one."""

    def __init__(self, error: OSError):
        super().__init__(f"cannot write to standard output: {error.strerror or error}")


class _GuardedStdout:
    """Standard output whose write errors are told apart from those of the files a command writes;
    a closed pipe (EPIPE) stays an OSError, which click already handles."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        return self._guarded(self._stream.write, text)

    def flush(self):
        return self._guarded(self._stream.flush)

    def _guarded(self, call, *args):
        try:
            return call(*args)
        except OSError as exc:
            if exc.errno == errno.EPIPE:
                global _reader_gone
                _reader_gone = True
                raise
            raise StdoutFailed(exc) from None

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _whole_writes(stream):
    """``stream``, or where it is a text layer straight over the raw file (``PYTHONUNBUFFERED=1``,
    ``python -u``), the same file behind a buffered layer: the raw layer takes the first 64 KB of a
    large write into a pipe whose reader has closed it, and the text layer drops the rest without an
    error, so ``search --json | head -c1`` exited 0 with the output cut; a buffered layer writes all
    of it or raises. Line buffering keeps the unbuffered mode's promptness."""
    raw = getattr(stream, "buffer", None)
    if not isinstance(raw, io.RawIOBase):
        return stream
    return io.TextIOWrapper(io.BufferedWriter(raw), encoding=stream.encoding, errors=stream.errors, line_buffering=True)


class _QuietStderr:
    """Standard error whose reader may go away (``2>&1 | head -1``): the messages are lost, the
    work is not. A failed write sends the rest of them to /dev/null and the command carries on
    (a training run to its end), exiting 141 like a writer whose reader closed its pipe."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        return self._quiet(self._stream.write, text, default=len(text))

    def flush(self):
        return self._quiet(self._stream.flush)

    def _quiet(self, call, *args, default=None):
        try:
            return call(*args)
        except OSError as exc:
            if exc.errno == errno.EPIPE:
                global _reader_gone
                _reader_gone = True
            _to_devnull(self._stream)
            return default

    def __getattr__(self, name):
        return getattr(self._stream, name)


MAX_MESSAGE_LINE = 2000  # characters of one error line; a value a message quotes whole can be megabytes


def _capped(line: str) -> str:
    """One error line of at most about MAX_MESSAGE_LINE characters, its start and end kept (where
    a message names the file and says what to do): a safety net for values quoted unshortened."""
    if len(line) <= MAX_MESSAGE_LINE:
        return line
    keep = MAX_MESSAGE_LINE // 2
    return f"{line[:keep]} ... ({len(line) - 2 * keep} characters left out) ... {line[-keep:]}"


class LazyGroup(click.Group):
    """A group whose subcommands are imported on first use."""

    def main(self, *args, **kwargs):
        """Run the command; a failed write to standard output, also when it is flushed at exit, is one
        line and exit code 2, never a traceback."""
        if sys.stdout is not None and not isinstance(sys.stdout, _GuardedStdout):
            sys.stdout = _GuardedStdout(_whole_writes(sys.stdout))
        if sys.stderr is not None and not isinstance(sys.stderr, _QuietStderr):
            sys.stderr = _QuietStderr(sys.stderr)
        from receipt_embed.stops import StoppedBySignal, signals_stop_the_command, stop_line

        try:
            try:
                with signals_stop_the_command(restore=not _console):
                    return super().main(*args, **kwargs)
            finally:
                sys.stdout.flush()
        except StoppedBySignal as stop:
            if not stop.reported and not _launcher_speaks():  # a lock it unwound has said which dir was left
                click.echo(printable(stop_line(stop)), err=True)
            sys.exit(stop.code)
        except BadInput as exc:  # bad input a command did not turn into its own message: still one line
            lines = getattr(exc, "lines", None) or [str(exc)]  # or one per problem (errors.BadInputLines)
            click.echo("Error: " + "\n".join(printable(_capped(line)) for line in lines), err=True)
            sys.exit(2)
        except StdoutFailed as exc:
            _to_devnull(sys.stdout)
            click.echo(f"Error: {exc}", err=True)
            sys.exit(2)
        except Exception as exc:  # not bad input: a bug, told apart from bad input by exit code 1
            from receipt_embed.stops import received

            if received and not _debug:  # the stop's exception arrived as another (a library wrapped it)
                if not _launcher_speaks():
                    click.echo(printable(stop_line(StoppedBySignal(received[-1]))), err=True)
                sys.exit(received[-1])
            if _out_of_memory(exc) and not _debug:  # a limit (ulimit -v) or too little RAM, not a bug
                where = getattr(exc, "what", "")  # images.DecodingOutOfMemory names the file
                click.echo(
                    printable(
                        "Error: out of memory (a memory limit such as `ulimit -v`, or too little RAM for this job)"
                        f"{' ' + where if where else ''}; raise the limit, or "
                        + _OUT_OF_MEMORY_ADVICE.get(self._command, "give the command less data")
                    ),
                    err=True,
                )
                sys.exit(2)
            if isinstance(exc, OSError) and exc.errno == errno.ENAMETOOLONG and not _debug:  # the user's path
                where = f"{shortened(os.fsdecode(exc.filename))}: " if exc.filename else ""
                click.echo(printable(f"Error: {where}a name in this path is too long for the file system"), err=True)
                sys.exit(2)
            if _debug:
                raise
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            click.echo(
                f"Error: internal error: {type(exc).__name__}{': ' + printable(detail) if detail else ''}\n"
                "This is a bug in receipt-embed or in one of its plugins, not a problem with your input; "
                "rerun with --debug (receipt-embed --debug COMMAND ...) to see the traceback, and report it.",
                err=True,
            )
            sys.exit(1)

    def list_commands(self, ctx):
        return sorted(COMMANDS)

    _command = None  # the subcommand being run: what an out-of-memory message can advise

    def resolve_command(self, ctx, args):
        name, command, rest = super().resolve_command(ctx, args)
        self._command = name
        return name, command, rest

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        target, _ = COMMANDS[name]
        module_name, attr = target.split(":")
        return getattr(importlib.import_module(module_name), attr)

    def invoke(self, ctx):
        _refuse_a_deleted_cwd()  # before a command's module, plugins or torch are loaded
        try:
            return super().invoke(ctx)
        except click.NoSuchOption as exc:  # a global option given after the command
            if exc.option_name in ("--plugins-dir", "--strict-plugins", "--debug"):
                exc.message += (
                    f" {exc.option_name} is an option of receipt-embed itself: put it before the command, "
                    f"e.g. receipt-embed {exc.option_name}{' DIR' if exc.option_name == '--plugins-dir' else ''} "
                    f"{ctx.invoked_subcommand or 'COMMAND'} ..."
                )
            raise

    def format_commands(self, ctx, formatter):
        rows = [(name, COMMANDS[name][1]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


def _refuse_a_deleted_cwd() -> None:
    """One line, exit 2, when the current directory was deleted (or swapped away) under the shell:
    relative paths and ``./plugins`` cannot be looked up, and torch fails to load with an MKL
    "fatal error" that reads like a broken install."""
    try:
        os.getcwd()
    except FileNotFoundError:
        from receipt_embed.cli.app import InputError

        raise InputError(
            "the current directory no longer exists (deleted or replaced): cd to an existing directory and run again"
        ) from None


def _launcher_speaks() -> bool:
    """A rank of ``train --nproc``: torchrun stops the other ranks with SIGTERM when one fails, and
    the launcher says in one line what happened, so a rank's own "stopped by" line is noise."""
    from receipt_embed.orphans import PARENT_PID_ENV

    return PARENT_PID_ENV in os.environ and os.environ.get("WORLD_SIZE", "1") not in ("", "1")


# what each command can shrink when memory runs out (only its own options and settings)
_OUT_OF_MEMORY_ADVICE = {
    "ingest": "shrink the largest images (a lower --max-pixels rejects them; ingest decodes up to 4 at once)",
    "make-samples": "shrink the largest scans",
    "train": "use a smaller data.image_size, train.batch_size or dataset",
    "index": "use a smaller --batch-size or dataset",
}


def _out_of_memory(exc: BaseException) -> bool:
    """MemoryError, or a library that could not be loaded for want of memory: under a small
    ``ulimit -v`` importing torch fails with "libtorch_cpu.so: failed to map segment from shared
    object" (an ImportError), which is the limit, not a broken install."""
    if isinstance(exc, MemoryError):
        return True
    if isinstance(exc, OSError) and exc.errno == errno.ENOMEM:
        return True
    text = str(exc)
    return isinstance(exc, ImportError) and ("failed to map segment" in text or "Cannot allocate memory" in text)


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """Warnings on the command line read as messages, not as source locations; they often
    quote values from files or plugins, so those print escaped, one warning a line."""
    from receipt_embed.display import printable

    click.echo(f"Warning: {printable(message)}", err=True)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="receipt-embed")
@click.option(
    "--plugins-dir",
    type=GivenPath(file_okay=False, path_type=str),
    envvar="RECEIPT_EMBED_PLUGINS_DIR",
    default=None,
    help="Folder of *.py plugins to load (default: ./plugins, or plugins.dir in the config).",
)
@click.option(
    "--strict-plugins",
    is_flag=True,
    envvar="RECEIPT_EMBED_STRICT_PLUGINS",
    help="Fail when a plugin cannot be loaded instead of warning and skipping it.",
)
@click.option(
    "--debug",
    is_flag=True,
    envvar="RECEIPT_EMBED_DEBUG",
    help="Show the traceback of an internal error (a bug) instead of a short message.",
)
@click.pass_context
def main(ctx: click.Context, plugins_dir: str | None, strict_plugins: bool, debug: bool) -> None:
    """Learn, index and audit image embeddings of photographed paper receipts."""
    from receipt_embed.cli.app import Application

    global _debug
    _debug = debug
    warnings.showwarning = _show_warning
    if plugins_dir is None and os.environ.get("RECEIPT_EMBED_PLUGINS_DIR") == "":  # click reads "" as unset
        from receipt_embed.cli.app import InputError

        raise InputError(
            "RECEIPT_EMBED_PLUGINS_DIR is set but empty (an unset shell variable?): name a plugins folder or unset it"
        )
    ctx.obj = Application(plugins_dir=plugins_dir, strict_plugins=strict_plugins, debug=debug)


def run() -> None:
    """The ``receipt-embed`` program: :func:`main`, then a SIGINT or SIGTERM while the interpreter
    exits (the command's work done and flushed) ends it at once with the stop's one line and exit
    code, instead of a silent death by the signal or a traceback from an exit handler."""
    global _console
    _console = True
    from receipt_embed.plugin_watch import children_end_with_the_command

    children_end_with_the_command()  # a plugin's forked child never outlives the command
    try:
        main()
        code = 0
    except SystemExit as done:
        code = done.code
    _stop_at_once_on_signals()
    # then leave at once: the interpreter's own shutdown puts the default handlers back and spends
    # a tenth of a second tearing torch down, long enough for a signal to kill the process silently
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed pipe or full disk was reported already; nothing more to say
            pass
    if _reader_gone and code in (0, 1):  # click's quiet exit, or output cut at the last flush: the usual code
        code = CLOSED_PIPE_EXIT
    os._exit(code or 0)


def _stop_at_once_on_signals() -> None:
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return

    from receipt_embed.stops import is_repeat, stop_signals

    def stop(signum, frame):
        if not is_repeat() and not _launcher_speaks():  # the first stop has said so already
            os.write(2, f"stopped by {signal.Signals(signum).name}\n".encode())
        os._exit(128 + signum)

    for sig in stop_signals():
        signal.signal(sig, stop)
