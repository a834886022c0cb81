"""k3_check.py — the verdict of a Python end-to-end test: one line per check ("ok   ..." or
"FAIL ..."), a last line counting the failures, and the exit code as the only report (STYLE.md
§18). Standard library only.

    from k3_check import check, verdict
    check(p.returncode == 0, "exit 0")
    sys.exit(verdict("my_test"))
"""
fails = []


def check(cond, msg):
    """Record one check; returns cond."""
    print(("ok   " if cond else "FAIL ") + msg, flush=True)
    if not cond:
        fails.append(msg)
    return bool(cond)


def verdict(name):
    """Print the count of failed checks; the process exit code (0 = all passed)."""
    print("%s: %d failed" % (name, len(fails)), flush=True)
    return 1 if fails else 0
