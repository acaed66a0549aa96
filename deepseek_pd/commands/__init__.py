"""Sub-commands of `deepseek-pd`; each module defines `register(subparsers)`.

Command modules must import heavy dependencies (torch, grpc, kopf) inside `func`, so that
`deepseek-pd --help` stays fast and one command's missing extra never breaks another.
"""
