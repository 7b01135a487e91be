"""A discrete-event simulator of speculative-decoding workers, to test and benchmark policies."""

from planner_svc.simulator.acceptance_process import DEFAULT_ALPHAS, AcceptanceProcess
from planner_svc.simulator.cost_surface import CostSurface, RooflineSettings, load_table, roofline
from planner_svc.simulator.oracle import oracle_gammas, oracle_policy
from planner_svc.simulator.simulation import SimConfig, SimResult, capacity_rps, simulate, trace_for
from planner_svc.simulator.trace import SHAPES, Trace, make_trace

__all__ = ["DEFAULT_ALPHAS", "SHAPES", "AcceptanceProcess", "CostSurface", "RooflineSettings", "SimConfig",
           "SimResult", "Trace", "capacity_rps", "load_table", "make_trace", "oracle_gammas", "oracle_policy",
           "roofline", "simulate", "trace_for"]
