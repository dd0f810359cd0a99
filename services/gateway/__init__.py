"""gateway: OpenAI-compatible REST and gRPC front door (auth, quotas, traffic class, validation).

Not built yet: issue [F1] fills this package. DESIGN.md section 3, step 1.
"""
