"""A small `redis-cli` for machines without one (tests/cluster/images.py): `-h`, `-p`, `-a`/`--pass` (else
$REDISCLI_AUTH, as redis-cli reads it: the chart's readiness probe authenticates so), `--user`, `-n`, `-u URL`,
`--no-auth-warning`, then one command. Prints the reply as redis-cli does for plain
replies, and, like redis-cli 7, exits 1 on an error reply."""

from __future__ import annotations

import argparse
import os
import sys

import redis


def main() -> int:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("-h", dest="host", default="127.0.0.1")
    p.add_argument("-p", dest="port", type=int, default=6379)
    p.add_argument("-a", "--pass", dest="password", default=os.environ.get("REDISCLI_AUTH"))
    p.add_argument("--user")
    p.add_argument("-n", dest="db", type=int, default=0)
    p.add_argument("-u", dest="url")
    p.add_argument("--no-auth-warning", action="store_true")
    p.add_argument("command", nargs="*")
    args = p.parse_args()
    client = redis.Redis.from_url(args.url) if args.url else redis.Redis(
        host=args.host, port=args.port, password=args.password, username=args.user, db=args.db)
    try:
        reply = client.execute_command(*(args.command or ["PING"]))
    except redis.ResponseError as exc:
        print(f"(error) {exc}")
        return 1
    except redis.RedisError as exc:
        print(f"Could not connect to Redis at {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    print("PONG" if reply is True else reply.decode() if isinstance(reply, bytes) else reply)
    return 0


if __name__ == "__main__":
    sys.exit(main())
