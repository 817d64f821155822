"""The loop's rules per row (rows at their own loops mean what a batch at one loop means), and the
shape of the code that holds them: every iteration over loops is semantics.py's, LoopedLM.forward's
or the exported model's stack step, and no function of megaloop/ runs past 80 lines."""

import ast
import textwrap
from typing import get_args

import pytest
import torch
from torch import nn

from megaloop.model import semantics
from megaloop.model.modes import EarlyExit, ReadoutMode
from support import ROOT

K = 4


@pytest.mark.parametrize("mode", get_args(ReadoutMode))
@pytest.mark.parametrize("trained", [2, 4])
def test_a_readout_per_row_is_each_rows_readout_at_its_loop(mode, trained):
    h = torch.randn(6, 8, generator=torch.Generator().manual_seed(0)) * 5
    norm = nn.RMSNorm(8)
    loop = torch.tensor([1, 2, 3, 4, 5, 2])
    got = semantics.readout_input(mode, h, loop, trained, 5, norm)
    for row, k in enumerate(loop.tolist()):
        want = semantics.readout_input(mode, h[row : row + 1], k, trained, 5, norm)
        assert torch.equal(got[row : row + 1], want), (mode, row, k)


def test_the_clamp_per_row_is_the_clamp_of_each_rows_own_loops():
    """Rows that start their loops at different steps are held at their own loop-1 RMS, as a
    batch that runs its loops together is."""
    g = torch.Generator().manual_seed(1)
    states = [torch.randn(3, 8, generator=g) * (1 + k) for k in range(5)]
    start = torch.tensor([0, 1, 2])  # the step at which each row is at loop 1
    reference = None
    for step, h in enumerate(states):
        loop = step - start + 1
        live = loop >= 1
        held, reference = semantics.hold(h, loop.clamp(min=1), reference)
        for row in live.nonzero().squeeze(1).tolist():
            clamp = semantics.Clamp()
            want = [clamp(states[s][row : row + 1]) for s in range(start[row], step + 1)][-1]
            assert torch.equal(held[row : row + 1], want), (step, row)


@pytest.mark.parametrize("rule", get_args(EarlyExit))
def test_an_exit_rule_per_row_decides_as_each_rows_own_rule(rule):
    """Two rows at different loops under one rule stop where each would alone; a row that
    starts a new token starts with its whole exit mass."""
    g = torch.Generator().manual_seed(2)
    lams = torch.rand(K, 2, generator=g)
    logits = torch.randn(K, 2, 16, generator=g)
    h = torch.zeros(2, 8)
    per_row = semantics.ExitRule(rule, 0.6, K)
    alone = [semantics.ExitRule(rule, 0.6, K) for _ in range(2)]
    loop = torch.tensor([1, 1])
    for step in range(K):
        stop = per_row.stop(loop, h, lams[step], logits[step])
        for row in range(2):
            want = alone[row].stop(
                int(loop[row]),
                h[row : row + 1],
                lams[step, row : row + 1],
                logits[step, row : row + 1],
            )
            assert bool(stop[row]) == bool(want[0]), (rule, step, row)
            if stop[row]:
                alone[row] = semantics.ExitRule(rule, 0.6, K)
        per_row.restart(stop)
        loop = torch.where(stop, 1, loop + 1)


# ---- where the loops are driven ---------------------------------------------------------------

APPLIES_A_LOOP = {"step", "loop", "stack", "enter", "feed_back", "recurrence", "hold", "stop"}
"""Calls that run a loop or a rule of one: the stack (the HF model's `step`, the training
model's `stack`), what a loop receives (`enter`, `feed_back`, `recurrence`), the clamp, the exit
decision."""
NOT_A_LOOP = {"torch", "optimizer", "scheduler", "self.ds", "survival", "self.survival"}
"""Receivers whose `step`/`stack` is something else: torch.stack, an optimizer's step, the
exit distribution's running product (a consumer of λ_k, not a driver)."""
LOOP_COUNTS = {"K", "num_loops", "k_max", "K_max", "deepest", "num_loops_trained"}
"""Names of a loop count: a `for` over a range of one counts loops, whatever its body calls."""
DRIVERS = {
    ("model/semantics.py", None),  # the whole module: every iteration over loops
    ("model/looped.py", "forward"),  # training: megatron-core's layers
    ("model/modeling_megaloop.py", "step"),  # the exported model's stack step
}


def counts_loops(statement: ast.For | ast.While) -> bool:
    """A `for` over range(…) of a loop count (K, self.K, config.num_loops, …)."""
    if not isinstance(statement, ast.For):
        return False
    it = statement.iter
    if not (isinstance(it, ast.Call) and getattr(it.func, "id", None) == "range"):
        return False
    names = {n.id for a in it.args for n in ast.walk(a) if isinstance(n, ast.Name)}
    names |= {n.attr for a in it.args for n in ast.walk(a) if isinstance(n, ast.Attribute)}
    return bool(names & LOOP_COUNTS)


def loops_over_loops(source: str, path: str) -> list[str]:
    """`for`/`while` statements that apply a loop in their body, outside the DRIVERS."""
    if (path, None) in DRIVERS:
        return []
    found = []

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, ast.FunctionDef) else function
            if isinstance(child, (ast.For, ast.While)) and (path, function) not in DRIVERS:
                if counts_loops(child):
                    found.append(f"{path}:{child.lineno} ({function}): {ast.unparse(child.iter)}")
                for call in ast.walk(child):
                    if not isinstance(call, ast.Call):
                        continue
                    f = call.func
                    called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                    receiver = ast.unparse(f.value) if isinstance(f, ast.Attribute) else ""
                    if called in APPLIES_A_LOOP and receiver not in NOT_A_LOOP:
                        found.append(f"{path}:{child.lineno} ({function}): {ast.unparse(f)}")
            visit(child, name)

    visit(ast.parse(source), None)
    return found


def test_the_loops_are_driven_in_semantics_and_the_stack_steps_only():
    """The issue-40 rule: decoders, measurements and caches step through semantics' drivers
    (trajectory, each_loop, each_step, first_exits) and never iterate over loops themselves."""
    found = []
    for file in sorted((ROOT / "megaloop").rglob("*.py")):
        rel = str(file.relative_to(ROOT / "megaloop"))
        found += loops_over_loops(file.read_text(), rel)
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "driver",
    [
        """
        def loops(self, h, rope, num_loops):
            for k in range(1, num_loops + 1):
                h = self.loop(h, k, rope)
                yield k, h
        """,
        """
        def exiting(self, tokens, cache, K):
            for k in range(1, K + 1):
                self.run_loop(k, tokens, cache)
        """,
        """
        def run(self, next_input):
            while True:
                self.step(next_input)
        """,
        """
        def early_exit(self, trajectory, rule):
            for k, h in trajectory:
                stop = rule.stop(k, h)
        """,
    ],
)
def test_the_scan_finds_the_drivers_the_decoders_had(driver):
    """The forms the exported model's `loops`, its cached and no-cache early exit and its async
    decoder took before issue 40 are found."""
    assert loops_over_loops(textwrap.dedent(driver), "model/decoding.py")


def test_no_function_in_megaloop_runs_past_80_lines():
    long = []
    for file in sorted((ROOT / "megaloop").rglob("*.py")):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > 80:
                    long.append(f"{file.relative_to(ROOT)}:{node.lineno} {node.name}: {length}")
    assert not long, "\n".join(long)


def test_the_exported_model_keeps_to_its_model():
    """modeling_megaloop.py is the HF model; the cache and decoders are decoding.py's."""
    lines = len((ROOT / "megaloop/model/modeling_megaloop.py").read_text().splitlines())
    assert lines <= 600, lines


def test_confidence_exits_where_the_top_probability_reaches_the_threshold():
    """One row whose readout puts 0.6 on its top token, one whose top token has 0.4: at 0.5 the
    first exits at loop 1 and the second goes on; both stop at loop K."""
    import torch

    from megaloop.model.semantics import ExitRule

    logits = torch.tensor([[0.6, 0.3, 0.1], [0.4, 0.35, 0.25]]).log()
    rule = ExitRule("confidence", 0.5, num_loops=3)
    h = torch.zeros(2, 4)
    assert rule.stop(1, h, logits=logits).tolist() == [True, False]
    assert ExitRule("confidence", 0.41, 3).stop(1, h, logits=logits).tolist() == [True, False]
    assert ExitRule("confidence", 0.39, 3).stop(1, h, logits=logits).tolist() == [True, True]
    assert rule.stop(3, h, logits=logits).tolist() == [True, True]
