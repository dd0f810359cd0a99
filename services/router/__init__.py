"""router: admission by KV pages and predicted TTFT, placement, overload stages.

Not built yet: issue [F1] fills this package. DESIGN.md section 3, step 2.
"""
