"""`serve --replicas N` for Ray's own tools: the application `positronic serve` would run on Ray,
made from serve's flags by name, for `serve run positronic.cli.cluster:application model=…
replicas=2`, a Serve config file's `import_path` or a KubeRay RayService (docs/cluster.md).

It lives with the command line, not in positronic/cluster/, because it reads the flags with the
command's own parser and checks (cli/serve.py), and positronic/cluster/ imports nothing of the
command line's parsing."""

from __future__ import annotations

from .common import UserError


def application(args: dict):
    """Ray Serve's application builder, for Ray's own tools: `serve run
    positronic.cli.cluster:application model=random:tiny replicas=2 session_store=s3://b/s`, or a
    config file's (or a KubeRay RayService's) `import_path` with `args:`. The args are `serve`'s
    flags by name (`budget: 256`, `session_dir: /mnt/shared`; a switch: true, or false for its
    `--no-` form; a switch whose other form has a name of its own, by that name:
    `checkpoint_when_idle: true`), checked as the command checks them (ValueError naming the flag);
    `replicas` at least 2. `host`, `port` and `ray_address` are Ray's to set there (its
    `http_options`), not these."""
    argv = []
    for key, value in args.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False:
            argv.append(f"--no-{flag[2:]}")
        else:
            for each in value if isinstance(value, (list, tuple)) else [value]:
                argv += [flag, str(each)]
    if int(args.get("replicas", 0)) < 2:
        raise ValueError("replicas must be 2 or more (one replica is the plain server: positronic serve)")
    from ..cluster.app import bind

    return bind(**cluster_plan(argv))


def cluster_plan(argv: list[str]) -> dict:
    """What `positronic serve ARGV --replicas N` would run on Ray, checked as the command checks
    it, without running it: the replicas' spec and their resources (for cluster/app.py's
    `bind`). UserError, or click's error for a bad flag, as ValueError."""
    import click
    import typer

    from . import _TyperError, app as cli_app
    from .serve import PLAN, PLAN_ONLY

    group = typer.main.get_command(cli_app)
    try:
        with group.make_context("positronic", ["serve", *argv]) as parent:
            name, command, rest = group.resolve_command(parent, ["serve", *argv])
            with command.make_context(name, rest, parent=parent) as ctx:
                ctx.meta[PLAN_ONLY] = True
                command.invoke(ctx)
                return ctx.meta[PLAN]
    except (_TyperError, click.ClickException) as exc:
        raise ValueError(" ".join(exc.format_message().split())) from None
    except UserError as exc:
        raise ValueError(str(exc)) from None
