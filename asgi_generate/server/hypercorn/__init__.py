"""Every patch to hypercorn, and nothing else: the fixes of its bugs
(:mod:`.fixes`), its worker classes' connections (:mod:`.asyncio_serve`,
:mod:`.trio_serve`), leaner per-connection objects (:mod:`.lean`) and the
app told when the graceful shutdown begins (:mod:`.graceful`),
installed together by :func:`.patches.install` once it has checked them
against the installed hypercorn; what they count of the connections they
close (:mod:`.edge_counts`). ``UPSTREAM.md`` gives each bug's report
for hypercorn's tracker and the test that shows it.
"""
