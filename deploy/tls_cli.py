"""``kvfleet tls``: the internal TLS directory (kvfleet.tls) of router <-> worker mutual TLS.

- ``kvfleet tls renew --dir DIR``: re-issue the worker, router and replica certificates in
  place (the same CA while it can sign; else a new one, trusted beside the old); then
  ``kill -HUP`` the routers. Workers pick the new files up at their next handshake.
- ``kvfleet tls show --dir DIR``: days each certificate has left (``--json`` too).

Exit codes: 0 done, 2 a usage or file error (the message names the file).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from kvfleet.tls import CERT_DAYS, expiry_report
from kvfleet.tls_ca import generate_internal_tls, renew_internal_tls


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvfleet tls", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, text in (("renew", "re-issue the certificates in place (creates the directory "
                                 "and a CA when empty)"),
                       ("show", "days to expiry of each certificate")):
        op = sub.add_parser(name, help=text)
        op.add_argument("--dir", required=True, help="the internal TLS directory")
        if name == "renew":
            op.add_argument("--days", type=int, default=CERT_DAYS,
                            help=f"validity of the new certificates (default {CERT_DAYS})")
        else:
            op.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.command == "renew":
            if args.days < 1:
                raise ValueError(f"--days must be >= 1, got {args.days}")
            from pathlib import Path

            fresh = not (Path(args.dir) / "ca.pem").is_file()
            (generate_internal_tls if fresh else renew_internal_tls)(args.dir, days=args.days)
            print(f"kvfleet: {'generated' if fresh else 'renewed'} {args.dir}; send SIGHUP to "
                  f"the routers (workers reload at their next handshake)", file=sys.stderr)
        report = expiry_report(args.dir)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if getattr(args, "json", False):
        print(json.dumps(report, indent=1))
    else:
        for name, c in report.items():
            print(f"{name}: " + (f"expires {c['expires']} ({c['days_left']:g} days left)"
                                 if "days_left" in c else f"unreadable: {c['error']}"))
    return 0 if all("days_left" in c for c in report.values()) else 2
