"""Batch jobs on Ray: the same job, its lines answered by workers on one machine or a cluster.

Ray (https://docs.ray.io) is an optional extra (``pip install 'multidecode[ray]'``); it is
imported only when a job runs on it. Ray places the workers, moves the lines and the outcomes,
and tells when a worker dies; this package only decides which line goes where. Its modules hold
one thing each: `connect` (finding Ray: installed, at an address), `errors` (a line's error
carried from a worker to the driver), `worker` (the actor: a model and a merged forest) and
`driver` (`RayWorkers`: which line goes to which worker, and what happens when one dies).

Terms: the *driver* is the process that holds the job (`BatchJob`: the output file, its lock,
resuming, the settings fingerprint); a *worker* is a Ray actor that holds a loaded model and a
`ForestAnswerer`; a line is *in flight* from its sending to a worker until its outcome arrives.

How it works: `ray_outcomes` connects to Ray (a new local Ray, or a cluster's address), starts
`workers` actors, each of which loads the model itself (the driver never loads it), and keeps up
to `lines_per_worker` lines in flight on each. A worker answers its lines concurrently (one Ray
thread per line, plus one for `ready`), so they merge into one forest on its engine thread, as
`BatchJob.run` merges them locally. Lines are pulled from `items` lazily, only when a worker has
room; each outcome is yielded as it arrives, and `BatchJob.record` appends it to the output::

    with open_batch("in.jsonl", "out.jsonl", settings) as job:
        for result in job.record(ray_outcomes(job.pending_items(), settings=settings, model=name,
                                              workers=2, stopping=lambda: job.stopping)):
            ...

What is guaranteed (on top of the job's own guarantees: one record per id, written as it
arrives, resumable from the output alone, changed settings refused):

- a worker that dies (its process killed, its node lost) has its lines in flight sent again, to
  another worker or to a replacement that Ray starts wherever there is room. A line sent again
  goes alone to an idle worker, and a line whose worker died `MAX_ATTEMPTS` times is recorded as
  failed (`WorkerDied`): a line that crashes its worker cannot crash them all in turn, nor take
  the lines that shared its worker down with it;
- no line is yielded twice: a line is yielded only from the outcome of its latest sending, and
  only once (and `BatchJob.record` drops a second outcome for a line as a second guard);
- errors come back with their class name, message and hint (`MultiDecodeError`s as themselves,
  anything else as a stand-in of the same class name), and one failed step that took several
  lines with it is still one error, so it counts once toward the job's crash limit;
- a problem with the job as a whole fails fast: Ray missing (`MissingExtra`), an address where no
  Ray answers (`RayUnavailable`, within `CONNECT_TIMEOUT_S`), a model that no worker can load
  (its own error, such as `ModelNotFound`), every worker gone and none can start (`WorkersLost`).

Answers are the local job's: each worker runs the same merged forest (`merged`), whose answers do
not depend on which lines share it. Only the order of the records differs (the order they finish).
"""

from .connect import CONNECT_TIMEOUT_S, RayUnavailable, connect, import_ray
from .driver import LINES_PER_WORKER, MAX_ATTEMPTS, MAX_FAILED_STARTS, RayWorkers, WorkerDied, WorkersLost, ray_outcomes
from .errors import ErrorInfo, RemoteError
from .worker import Worker

__all__ = ["CONNECT_TIMEOUT_S", "LINES_PER_WORKER", "MAX_ATTEMPTS", "MAX_FAILED_STARTS", "ErrorInfo", "RayUnavailable",
           "RayWorkers", "RemoteError", "Worker", "WorkerDied", "WorkersLost", "connect", "import_ray", "ray_outcomes"]
