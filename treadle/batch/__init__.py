"""The OpenAI Batch API's machinery, below the HTTP server (docs/batch.md).

    config.py   BatchConfig (`treadle serve`'s batch flags), completion windows
    lines.py    an input file's lines checked (line and field named), output lines made
    store.py    files, batches and each line's outcome: SQLite (WAL) + files on disk
    runner.py   BatchRunner: validates, runs lines in a window, cancels, expires,
                finalizes, and resumes whatever a dead server left unfinished

Nothing here imports the server or the engine: a line is run by a callable the runner is
handed (server/batch_lines.py runs it through the serving object, exactly as a live
request); the routes are server/batch_routes.py, `treadle run-batch` is
server/batch_offline.py.
"""
