"""Where Triton puts a warp-specialised kernel's hand-out of its partitions, in the source and in the PTX.

Before the partitions run, the default warps store one state byte per worker warp (which partition it runs) and
release the workers with ``barrier.sync 1``, which every thread executes; each worker warp loads its byte. After the
partitions the default warps store the "exit" state the same way. Triton attributes these accesses to the kernel's
``def`` line and to the top-level statement that holds ``gl.warp_specialize`` (3.6 and 3.7 put the exit store
there, 3.8 and 3.9 on the ``def`` line). ``sanitize.py`` explains racecheck's hazards between such accesses, and
``compile_sm90.py`` checks that the PTX has no other shared-memory access at those lines, so that the explanation
can never cover one of the kernel's own. Design: docs/design/triton-kernels.md (Under compute-sanitizer).
"""

from __future__ import annotations

import ast
import re

#: A shared-memory access in PTX (mbarrier operations aside): its operation and its operands.
_ACCESS = re.compile(r"^\s*((?:ld|st|atom|red)\.shared\S*)\s+([^;]*);", re.M)
#: The hand-out's accesses: the default warps' stores of two 32-bit words of state bytes (immediates) to one address,
#: and the worker warps' byte loads.
_STATE_STORE = "st.shared.v2.b32"
_STATE_OPERANDS = re.compile(r"^\[global_smem\+(\d+)\],\s*\{\d+,\s*\d+\}$")
_STATE_LOADS = ("ld.shared.b8", "ld.shared.u8")
_LOC = re.compile(r"^\s*\.loc\s+(\d+)\s+(\d+)\s+\d+", re.M)
_FILE = re.compile(r'^\s*\.file\s+(\d+)\s+"([^"]*)"', re.M)


def handout_lines(source: str, function: str) -> frozenset[int]:
    """The lines of ``source`` (a module's text) to which Triton attributes ``function``'s hand-out of its
    partitions (:func:`function_handout_lines`). Empty if ``function`` is not in ``source``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == function:
            return function_handout_lines(node)
    return frozenset()


def function_handout_lines(function: ast.FunctionDef) -> frozenset[int]:
    """The lines to which Triton attributes ``function``'s hand-out of its partitions: its ``def`` line and the
    top-level statement of its body that holds the ``warp_specialize`` call. Empty if it specialises no warps."""
    for statement in function.body:
        calls = (n for n in ast.walk(statement) if isinstance(n, ast.Call))
        if any(isinstance(c.func, ast.Attribute) and c.func.attr == "warp_specialize" for c in calls):
            return frozenset({function.lineno, statement.lineno})
    return frozenset()


def accesses_at(ptx: str, file_name: str, lines: frozenset[int]) -> list[tuple[str, str]]:
    """The shared-memory accesses of ``ptx`` whose source location (the last ``.loc`` before them) is one of
    ``lines`` of a file named ``file_name``: ``(operation, operands)`` each, registers as written."""
    files = {m.group(1) for m in _FILE.finditer(ptx) if m.group(2).replace("\\", "/").split("/")[-1] == file_name}
    locs = [(m.start(), (m.group(1), int(m.group(2)))) for m in _LOC.finditer(ptx)]
    found, i, here = [], 0, ("", 0)
    for m in _ACCESS.finditer(ptx):
        while i < len(locs) and locs[i][0] < m.start():
            here = locs[i][1]
            i += 1
        if here[0] in files and here[1] in lines:
            found.append((m.group(1), " ".join(m.group(2).split())))
    return found


def foreign_accesses(ptx: str, file_name: str, lines: frozenset[int]) -> list[str]:
    """The accesses at ``lines`` of ``file_name`` (:func:`accesses_at`) that are not the hand-out's: not a store of
    two immediate words of state bytes to the one address the other state stores take, nor a byte load. Empty for a
    kernel whose racecheck hazards at those lines are all the hand-out's."""
    foreign, addresses = [], set()
    for op, operands in accesses_at(ptx, file_name, lines):
        store = _STATE_OPERANDS.match(operands)
        if op == _STATE_STORE and store:
            addresses.add(store.group(1))
        elif op not in _STATE_LOADS:
            foreign.append(f"{op} {operands}")
    if len(addresses) > 1:
        foreign.append(f"state stores to {len(addresses)} addresses: global_smem+{', +'.join(sorted(addresses))}")
    return foreign
