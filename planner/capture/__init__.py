"""From a model file to blocks and legal cuts (torch).

Owns: ``load`` (import a model file, SIZES and --set, the contract's functions with one-line
errors), ``blocks`` (the trace types: Block, Cut, GraphTrace, ModuleTrace), ``graph`` (fx and
export tracing, grouping nodes into blocks, cut liveness on the networkx block graph), ``modules``
(the module-boundary fallback), ``trace`` (the fallback chain), ``stage`` (cutting a stage
module out of a graph trace), ``shapes`` (running a module on fake tensors for the runner's shapes).

May import: ``planner.errors``, ``planner.schema``, ``planner.torch_compat``, torch, networkx.
"""
