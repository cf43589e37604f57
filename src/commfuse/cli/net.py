"""``commfuse net``: build, inspect and remove emulated clusters (netlab) by hand.

``net up`` leaves a lab running after the command ends, so other programs (``ip netns exec``,
torchrun) can use it; ``net down`` and ``net status`` find it again through its state file and
its names. ``net check`` answers "does shaping work on this machine?" without leaving anything.
Bad input and missing privileges exit with status 2 and one line saying what to change, before
anything is built; a failure while building exits 1 (``cli.common.run_command``).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from commfuse.cli.common import (
    Subparsers,
    UsageError,
    add_topology_arguments,
    check_topology_flags,
    set_command,
)
from commfuse.cli.output import write_output
from commfuse.cluster.netlab import (
    LAB_ID_LEN,
    LAB_PREFIX,
    Netlab,
    down_all,
    list_labs,
    netlab_unavailable_reason,
    self_check,
)
from commfuse.cluster.topology import Topology
from commfuse.units import format_rate

#: A measured rate further than this from the spec fails ``net check``.
_TOLERANCE = 0.15


def _topology(args: argparse.Namespace) -> Topology:
    check_topology_flags(args)
    return Topology.from_spec(
        hosts=args.hosts, ranks_per_host=args.ranks_per_host or 1, link=args.link
    )


def _write_json(args: argparse.Namespace, obj: Any) -> None:
    """``--json``: print to stdout for ``-`` (the flag alone), else write the file."""
    text = json.dumps(obj, indent=2)
    if args.json == "-":
        print(text)
    else:
        write_output(args, args.json, text + "\n")


def _print_check(result: dict[str, Any]) -> bool:
    """Print measured vs spec rate per direction; True when within _TOLERANCE (or unshaped)."""
    spec = result["spec_mbit"]
    spec_text = "unshaped" if spec is None else format_rate(spec)
    for pair in result["pairs"]:
        ratio = pair["ratio"]
        pct = "" if ratio is None else f" ({100 * ratio:.1f}% of spec)"
        print(
            f"  host {pair['src']} -> host {pair['dst']}: {pair['measured_mbit']:.1f} Mbit/s, "
            f"spec {spec_text}{pct}"
        )
    print(f"  tbf drops: {result['drops']}  ({result['num_bytes']} bytes per direction)")
    ratio = result["ratio"]
    ok = ratio is None or abs(ratio - 1.0) <= _TOLERANCE
    if not ok:
        print(f"  WARNING: measured rate is off the spec by more than {100 * _TOLERANCE:.0f}%")
    return ok


def _describe(lab: Netlab) -> None:
    print(f"lab {lab.lab_id}: {lab.topology.describe()}")
    for k in range(lab.topology.num_hosts):
        print(
            f"  host {k}: netns {lab.namespace(k)}  addr {lab.address(k)}  ifname {lab.ifname(k)}"
        )


def _require_netlab() -> None:
    """UsageError (exit 2) where this machine cannot build namespaces (not root, no ``ip``)."""
    reason = netlab_unavailable_reason()
    if reason is not None:
        raise UsageError(reason)


def _cmd_up(args: argparse.Namespace) -> int:
    """Build a lab that outlives this command, describe it and self-check its links."""
    topology = _topology(args)
    lab = Netlab(topology, mtu=args.mtu, burst_kb=args.burst_kb)
    _require_netlab()
    try:
        lab.up()
        _describe(lab)
        if topology.num_hosts >= 2 and not args.no_check:
            print("self-check:")
            _print_check(self_check(lab))
        lab.keep()
    except BaseException:
        lab.down()
        raise
    print(f"run a command on host 0: ip netns exec {lab.namespace(0)} COMMAND")
    print(f"remove with: commfuse net down {lab.lab_id}")
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    """Remove one lab by id, or every lab and leftover (``--all``)."""
    if args.all and args.lab_id is not None:
        raise ValueError("give a LAB_ID or --all, not both")
    if not args.all and args.lab_id is None:
        raise ValueError("give the LAB_ID to remove (see `commfuse net status`), or --all")
    lab_id = args.lab_id
    if lab_id is not None and not (lab_id.startswith(LAB_PREFIX) and len(lab_id) == LAB_ID_LEN):
        raise ValueError(f"bad lab id {lab_id!r}: ids look like cfuse3fa2")
    _require_netlab()
    if lab_id is not None and all(lab["lab_id"] != lab_id for lab in list_labs()):
        raise ValueError(f"no lab {lab_id} on this machine; `commfuse net status` lists them")
    removed = down_all(lab_id or LAB_PREFIX)
    for item in removed:
        print(f"removed {item}")
    if not removed:
        print("nothing to remove")
    return 0


def _age(created: Any) -> str:
    if not isinstance(created, (int, float)):
        return "?"
    seconds = max(0, int(time.time() - created))
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds}s"


def _cmd_status(args: argparse.Namespace) -> int:
    """List labs from state files and leftover namespaces/links (orphans of a crash)."""
    labs = list_labs()
    if args.json:
        _write_json(args, labs)
        return 0
    if not labs:
        print("no labs")
        return 0
    rows = [("LAB", "STATUS", "HOSTS", "LINK", "PID", "AGE", "NETNS", "LINKS")]
    for lab in labs:
        link = lab.get("link_mbit")
        link_text = (
            "?" if "num_hosts" not in lab else "unshaped" if link is None else format_rate(link)
        )
        rows.append(
            (
                lab["lab_id"],
                lab["status"],
                str(lab.get("num_hosts", "?")),
                link_text,
                str(lab.get("pid", "?")),
                _age(lab.get("created")),
                str(len(lab["namespaces"])),
                str(len(lab["links"])),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    if any(lab["status"] == "orphan" for lab in labs):
        print("orphans are leftovers of a crashed program: `commfuse net down --all` removes them")
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    """Build a temporary lab, measure its links against the spec, tear it down."""
    topology = _topology(args)
    if topology.num_hosts < 2:
        raise ValueError(f"--hosts must be at least 2 for a check, got {topology.num_hosts}")
    lab = Netlab(topology, mtu=args.mtu, burst_kb=args.burst_kb)
    _require_netlab()
    with lab:
        _describe(lab)
        result = self_check(lab)
    if args.json:
        _write_json(args, result)
        return 0 if result["ratio"] is None or abs(result["ratio"] - 1) <= _TOLERANCE else 1
    return 0 if _print_check(result) else 1


def _lab_options(parser: argparse.ArgumentParser, *, hosts: int | None, link: str | None) -> None:
    add_topology_arguments(parser, default_hosts=hosts, default_link=link, emulate_flag=False)
    parser.add_argument("--mtu", type=int, default=9000, help="MTU of every link (default 9000)")
    parser.add_argument("--burst-kb", type=int, default=256, help="tbf burst in KiB (> MTU)")


def _json_option(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--json",
        metavar="PATH",
        nargs="?",
        const="-",
        help=f"write {what} as JSON (no PATH: print it instead of the table)",
    )


def register(subparsers: Subparsers) -> None:
    """Add ``net up|down|status|check`` to the ``commfuse`` command."""
    net = subparsers.add_parser(
        "net",
        help="emulated cluster: network namespaces with shaped links (needs root)",
        description="Build, inspect and remove emulated clusters (netlab).",
    )

    def net_help(args: argparse.Namespace) -> int:
        net.print_help()
        return 2

    set_command(net, net_help)
    sub = net.add_subparsers(dest="net_command", metavar="NET_COMMAND")

    up = sub.add_parser("up", help="build a lab that outlives this command, then self-check it")
    _lab_options(up, hosts=None, link=None)
    up.add_argument("--no-check", action="store_true", help="skip the link self-check")
    set_command(up, _cmd_up)

    down = sub.add_parser("down", help="remove a lab (LAB_ID) or every lab and leftover (--all)")
    down.add_argument("lab_id", nargs="?", metavar="LAB_ID", help="lab to remove, e.g. cfuse3fa2")
    down.add_argument("--all", action="store_true", help="remove every lab and leftover")
    set_command(down, _cmd_down)

    status = sub.add_parser("status", help="list labs, including leftovers of crashed programs")
    _json_option(status, "the labs")
    set_command(status, _cmd_status)

    check = sub.add_parser("check", help="temporary lab: measure link rate vs spec, tear down")
    _lab_options(check, hosts=2, link="1gbit")
    _json_option(check, "the measured rates")
    set_command(check, _cmd_check)
