"""The wafer compiler: capture a model, choose a strategy, place regions, project speed, draw the result.

    plan = compile_model(model="llama3.1-70b", target="wse3", systems=4)
    print(plan_summary(plan)); write_outputs(plan, "out/")
"""

from waferscale.compiler.api import estimate_memory, estimate_table, plan_json, plan_summary, write_outputs
from waferscale.compiler.compile import compile_model
from waferscale.compiler.ir import Graph, MatMul, Unit
from waferscale.compiler.plan import PLAN_VERSION, Plan, Region

__all__ = ["compile_model", "plan_summary", "plan_json", "write_outputs", "estimate_memory", "estimate_table",
           "Plan", "Region", "Graph", "Unit", "MatMul", "PLAN_VERSION"]
