#!/usr/bin/env python3
"""module_graph.py — the module layering of DESIGN.md §1, checked on the sources.

Reads every `#include "..."` of every .c/.h/.cu under the module folders, maps the included
header to the module (top-level folder) that holds it, and fails on any edge the layering
forbids. Dependencies point down:

    launcher → server → client → rank → {coordinator, layers, experts, comm, partition, host}
             → model → kernels → base

Any module may include a module below it, except where the table below narrows it (coordinator
touches no weights, partition is pure, kernels is the floor, host knows only base and hwloc,
client is the engine's clients' layer: no kernels, layers or experts; server includes client but
not comm or model). tiny (the `k3 make-tiny` writer) sits
on the middle level, above model: it may include only model, kernels and base, and only launcher
includes it (model never does: the loader does not know the writer). Among the middle siblings only
layers → experts, layers → comm and experts → comm are allowed, and into comm only through its
interface header k3_comm.h. Another module's *_internal.h is never included. The observed module
graph must have no cycle. System headers: <mpi.h> only in comm/ and launcher/ (MPI init/abort; layers never call MPI),
CUDA/NCCL headers only in kernels/cuda/, comm/nccl_emu/ (the emulation's NCCL stand-in) and
comm/comm_nccl.c (STYLE.md §13). Inside rank/, each role's state struct (ROOMS) is defined only
in its own file, so no other file of rank/ sees it.

Usage: module_graph.py [ROOT]   (ROOT = the repository; default: K3_SRC or this file's ../..)
       module_graph.py --self-test [ROOT]
Prints each forbidden edge as `file:line: module A includes B (header)`; exit 0 = clean, 1 = a
forbidden edge, an unknown header or a cycle, 2 = usage. --self-test copies the module folders
to a temporary directory, injects one forbidden include at a time (kernels → model, layers →
rank, coordinator → model, experts → layers, a cycle, <mpi.h> in layers/, server → model,
<mpi.h> in server/, model → tiny, rank → tiny, tiny → layers, rank → client, host → rank,
layers → host, client → layers, client → kernels, a role's struct of rank/ defined outside its
room) and checks that each is reported with its file and line; exit 0 only if every injection is
caught.
"""
import io
import os
import re
import shutil
import sys
import tempfile
from contextlib import redirect_stdout

# The layers of DESIGN.md §1, bottom = 0. The five middle siblings share one level.
LEVEL = {
    "base": 0,
    "kernels": 1,
    "model": 2,
    "coordinator": 3, "layers": 3, "experts": 3, "comm": 3, "partition": 3,
    "tiny": 3,       # `k3 make-tiny`: the checkpoint writer, its BPE trainer and corpus
    "host": 3,       # the hwloc core binding of a rank (k3_bind.h): base + hwloc only
    "rank": 4,       # the engine (k3_engine.h)
    "client": 5,     # the engine's clients' layer: `k3 run`'s driver (k3_run.h), chat_job.h
    "server": 6,     # the HTTP server of `k3 serve`
    "launcher": 7,
}
MODULES = sorted(LEVEL)

# Narrower than "anything below": module -> the only modules it may include (besides itself).
ONLY = {
    "base": {"base"},
    "kernels": {"kernels", "base"},          # the floor: nothing above it (DESIGN.md §1 table)
    "coordinator": {"coordinator", "base"},  # tokenizer, chat, parser, sampler: touches no weights
    "partition": {"partition", "model", "base"},  # pure functions of the config
    "comm": {"comm", "kernels", "base"},     # knows no layer or config: bytes and backend buffers
    "host": {"host", "base"},                # this machine's cores (hwloc): nothing of the model
    # the clients of the engine API: requests, events, results; no weights or kernels
    "client": {"client", "rank", "coordinator", "comm", "model", "partition", "base"},
    "server": {"server", "client", "rank", "coordinator", "base"},  # no weights, no MPI
    "tiny": {"tiny", "model", "kernels", "base"},  # writes through model's public API
}
# Narrower than "anything above": module -> the only modules that may include it.
USED_BY = {
    "tiny": {"launcher"},                    # `k3 make-tiny` (and the tests, not scanned here)
}
# Sibling edges on the middle level: (from, to) -> the headers of `to` that may be included.
SIBLING = {
    ("layers", "experts"): None,             # None: any public header of the module
    ("layers", "comm"): {"k3_comm.h"},       # the comm interface only
    ("experts", "comm"): {"k3_comm.h"},
}

MPI_OK = {"comm", "launcher"}                # <mpi.h>: comm, and MPI init/abort in launcher
DEVICE_OK_DIRS = ("kernels/cuda/", "comm/nccl_emu/")  # <cuda*.h>, <cu*.h>, <nccl.h>; nccl_emu:
# the NCCL stand-in of the emulation build (its nccl.h names cudaStream_t)
DEVICE_OK_FILES = ("comm/comm_nccl.c",)
DEVICE_RE = re.compile(r"^(cuda[^/]*\.h|cu[a-zA-Z_]*\.h|nccl\.h|nvml\.h|cub/.*|thrust/.*)$")

# The rooms of rank/ (rank/rank_internal.h): each role's state is a struct defined in its own file
# only, so no other file of rank/ can see it (the shared rank_ctx holds opaque pointers).
ROOMS = {
    "k3_engine": "rank/engine.c",       # the engine API's own totals
    "rank_worker": "rank/worker.c",     # the stage worker of a lane
    "rank_coord": "rank/scheduler.c",   # the coordinator: requests, slots, groups, events
    "rank_load": "rank/setup.c",        # the load: heartbeat, bar, --verify list
    "rank_opstats": "rank/opstats.c",   # --op-stats counters
    "rank_hooks": "rank/hooks.c",       # the test hooks (k3_engine_test.h)
}
STRUCT_DEF_RE = re.compile(r"\bstruct\s+(" + "|".join(ROOMS) + r")\s*\{")

INCLUDE_RE = re.compile(r'^\s*#\s*include\s*([<"])([^">]+)[">]')
SOURCE_EXT = (".c", ".h", ".cu", ".cuh")


def sources(root):
    for mod in MODULES:
        top = os.path.join(root, mod)
        for dirpath, dirnames, files in os.walk(top):
            dirnames.sort()
            for f in sorted(files):
                if f.endswith(SOURCE_EXT):
                    yield mod, os.path.join(dirpath, f)


def allowed(a, b, header):
    """None if module a may include header of module b, else the reason it may not."""
    if a == b:
        return None
    if header.endswith("_internal.h"):
        return "another module's internal header"
    if b in USED_BY and a not in USED_BY[b]:
        return f"only {', '.join(sorted(USED_BY[b]))} may include {b}"
    if a in ONLY:
        return None if b in ONLY[a] else f"{a} may include only {', '.join(sorted(ONLY[a]))}"
    if LEVEL[b] < LEVEL[a]:
        return None
    if (a, b) in SIBLING:
        ok = SIBLING[(a, b)]
        return None if ok is None or header in ok else \
            f"{a} may include only {', '.join(sorted(ok))} of {b}"
    if LEVEL[b] == LEVEL[a]:
        return "siblings on the middle level do not include each other"
    return "an upward edge"


def find_cycle(graph):
    """A list of modules forming a cycle in {module: set(modules)}, or None."""
    state = {}
    stack = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                c = visit(n)
                if c:
                    return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            c = visit(m)
            if c:
                return c
    return None


def check(root):

    files = list(sources(root))
    owner = {}       # header basename -> module
    for mod, path in files:
        if path.endswith((".h", ".cuh")):
            name = os.path.basename(path)
            if name in owner and owner[name] != mod:
                print(f"{os.path.relpath(path, root)}: header {name} also in {owner[name]}/ "
                      "(a header name must map to one module)")
                return 1
            owner[name] = mod

    bad = 0
    n_edges = 0
    graph = {m: set() for m in MODULES}
    for mod, path in files:
        rel = os.path.relpath(path, root)
        with open(path, encoding="utf-8", errors="replace") as f:
            for ln, line in enumerate(f, 1):
                m = INCLUDE_RE.match(line)
                if not m:
                    continue
                kind, inc = m.groups()
                if kind == "<":
                    why = None
                    if inc == "mpi.h" and mod not in MPI_OK:
                        why = "MPI outside comm/ and launcher/"
                    elif DEVICE_RE.match(inc) and not (rel.startswith(DEVICE_OK_DIRS)
                                                        or rel in DEVICE_OK_FILES):
                        why = "CUDA/NCCL outside kernels/cuda/, comm/nccl_emu/ and comm/comm_nccl.c"
                    if why:
                        print(f"{rel}:{ln}: module {mod} includes <{inc}> ({why})")
                        bad += 1
                    continue
                name = os.path.basename(inc)
                local = os.path.normpath(os.path.join(os.path.dirname(path), inc))
                if os.path.isfile(local):
                    top = os.path.relpath(local, root).split(os.sep)[0]
                    target = top if top in LEVEL else None
                else:
                    target = owner.get(name)
                if target is None:
                    print(f"{rel}:{ln}: module {mod} includes \"{inc}\", a header of no module")
                    bad += 1
                    continue
                n_edges += 1
                if target != mod:
                    graph[mod].add(target)
                why = allowed(mod, target, name)
                if why:
                    print(f"{rel}:{ln}: module {mod} includes {target} ({name}): {why}")
                    bad += 1

    for mod, path in files:  # the rooms of rank/
        rel = os.path.relpath(path, root).replace(os.sep, "/")
        with open(path, encoding="utf-8", errors="replace") as f:
            for ln, line in enumerate(f, 1):
                for m in STRUCT_DEF_RE.finditer(line):
                    if ROOMS[m.group(1)] != rel:
                        print(f"{rel}:{ln}: struct {m.group(1)} defined outside its room "
                              f"{ROOMS[m.group(1)]} (another role's state)")
                        bad += 1

    cycle = find_cycle(graph)
    if cycle:
        print("module_graph: cycle " + " → ".join(cycle))
        bad += 1
    print("module graph: " + "; ".join(f"{m} → {', '.join(sorted(graph[m])) or '-'}"
                                       for m in sorted(MODULES, key=lambda m: (-LEVEL[m], m))))
    print(f"module_graph: {len(files)} files, {n_edges} quoted includes, "
          f"{bad} forbidden edge{'s' if bad != 1 else ''}")
    return 1 if bad else 0


# (file to edit, line to append, text the report must contain)
INJECTIONS = [
    ("kernels/k3_kernels.h", '#include "k3_model.h"',
     "kernels/k3_kernels.h:{n}: module kernels includes model (k3_model.h)"),
    ("layers/stage.c", '#include "k3_engine.h"',
     "layers/stage.c:{n}: module layers includes rank (k3_engine.h)"),
    ("coordinator/sampler.c", '#include "k3_model.h"',
     "coordinator/sampler.c:{n}: module coordinator includes model (k3_model.h)"),
    ("experts/moe.c", '#include "k3_layers.h"',
     "experts/moe.c:{n}: module experts includes layers (k3_layers.h)"),
    ("model/config.c", '#include "k3_partition.h"', "module_graph: cycle"),
    ("layers/kda.c", "#include <mpi.h>", "layers/kda.c:{n}: module layers includes <mpi.h>"),
    ("server/server.c", '#include "k3_model.h"',
     "server/server.c:{n}: module server includes model (k3_model.h)"),
    ("server/server.c", "#include <mpi.h>", "server/server.c:{n}: module server includes <mpi.h>"),
    ("model/catalog.c", '#include "k3_tiny.h"',
     "model/catalog.c:{n}: module model includes tiny (k3_tiny.h)"),
    ("rank/setup.c", '#include "k3_tiny.h"',
     "rank/setup.c:{n}: module rank includes tiny (k3_tiny.h): only launcher may include tiny"),
    ("tiny/make_tiny.c", '#include "k3_layers.h"',
     "tiny/make_tiny.c:{n}: module tiny includes layers (k3_layers.h)"),
    ("rank/setup.c", '#include "k3_run.h"',
     "rank/setup.c:{n}: module rank includes client (k3_run.h): an upward edge"),
    ("host/bind.c", '#include "k3_engine.h"',
     "host/bind.c:{n}: module host includes rank (k3_engine.h)"),
    ("layers/stage.c", '#include "k3_bind.h"',
     "layers/stage.c:{n}: module layers includes host (k3_bind.h)"),
    ("client/run.c", '#include "k3_layers.h"',
     "client/run.c:{n}: module client includes layers (k3_layers.h)"),
    ("client/chat_job.c", '#include "k3_kernels.h"',
     "client/chat_job.c:{n}: module client includes kernels (k3_kernels.h)"),
    ("rank/rank_internal.h", "struct rank_coord { int n_reqs; };",
     "rank/rank_internal.h:{n}: struct rank_coord defined outside its room rank/scheduler.c"),
    ("rank/scheduler.c", "struct rank_worker {",
     "rank/scheduler.c:{n}: struct rank_worker defined outside its room rank/worker.c"),
]


def self_test(root):
    bad = 0
    with tempfile.TemporaryDirectory(prefix="k3_module_graph_") as tmp:
        for mod in MODULES:
            shutil.copytree(os.path.join(root, mod), os.path.join(tmp, mod),
                            ignore=lambda d, names: [n for n in names if not os.path.isdir(
                                os.path.join(d, n)) and not n.endswith(SOURCE_EXT)])
        for rel, line, want in INJECTIONS:
            path = os.path.join(tmp, rel)
            with open(path, encoding="utf-8") as f:
                orig = f.read()
            text = orig if orig.endswith("\n") else orig + "\n"
            n = text.count("\n") + 1
            with open(path, "w", encoding="utf-8") as f:
                f.write(text + line + "\n")
            out = io.StringIO()
            with redirect_stdout(out):
                rc = check(tmp)
            with open(path, "w", encoding="utf-8") as f:
                f.write(orig)
            want = want.format(n=n)
            if rc == 1 and want in out.getvalue():
                print(f"ok   caught {rel} + {line}")
            else:
                print(f"FAIL {rel} + {line}: rc={rc}, report lacks '{want}':")
                print(out.getvalue())
                bad += 1
    print(f"module_graph self-test: {len(INJECTIONS) - bad} passed, {bad} failed")
    return 1 if bad else 0


def main(argv):
    args = argv[1:]
    test = bool(args) and args[0] == "--self-test"
    if test:
        args = args[1:]
    if len(args) > 1 or any(a.startswith("-") for a in args):
        print("usage: module_graph.py [--self-test] [ROOT]", file=sys.stderr)
        return 2
    here = os.path.dirname(os.path.abspath(__file__))
    root = args[0] if args else os.environ.get("K3_SRC", os.path.join(here, "..", ".."))
    root = os.path.abspath(root)
    missing = [m for m in MODULES if not os.path.isdir(os.path.join(root, m))]
    if missing:
        print(f"module_graph: {root}: no module folder {', '.join(missing)}", file=sys.stderr)
        return 2
    return self_test(root) if test else check(root)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
