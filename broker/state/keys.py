"""Every Redis key name SITS uses, built in one place.

All keys share one hash tag (`{group}`) so that a Lua script may touch any
of them and the layout can move to Redis Cluster by giving each model group
its own tag. Lua scripts get key names as KEYS; they build only the names beside a ready queue
(`ready_of_tenant` and its marks, from the ready key) and request hashes' (from `request('')`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    """Key names under one prefix and hash tag."""

    prefix: str = "sits"
    group: str = "main"

    def _key(self, *parts: str) -> str:
        return ":".join((self.prefix, "{" + self.group + "}", *parts))

    # --- queues -----------------------------------------------------------
    def ready(self, model_ref: str) -> str:
        """ZSET item id -> priority score (lower runs first) of items waiting for `model_ref`."""
        return self._key("ready", model_ref)

    def ready_of_tenant(self, model_ref: str, tenant: str) -> str:
        """ZSET item id -> the same score, of `tenant`'s items in `ready(model_ref)` ('' for items without a
        tenant): how a fair-share lease finds a ranked tenant's work however deep the queue. The ready key
        with a suffix (no model ref or tenant holds '|'), which lib.lua builds the same way (`tenant_index`),
        so the scripts that add to or remove from a ready queue keep it without a KEYS entry of their own."""
        return f"{self.ready(model_ref)}|{tenant}"

    def ready_of_tenant_built(self, model_ref: str) -> str:
        """STRING present while `ready_of_tenant` holds every waiting item of `model_ref` (lib.lua builds the
        name too): set when the queue starts empty, or by the reaper passes that index a queue stored before
        the indexes (`broker.queueing.tenant_index`); until then a lease weighs the window alone."""
        return f"{self.ready(model_ref)}#by-tenant-built"

    def ready_of_tenant_cursor(self, model_ref: str) -> str:
        """STRING the ZSCAN cursor of the walk that builds `model_ref`'s tenant indexes (`index_ready.lua`)."""
        return f"{self.ready(model_ref)}#by-tenant-cursor"

    def inflight(self, model_ref: str) -> str:
        """ZSET item id -> lease deadline (unix seconds) of items a worker holds."""
        return self._key("inflight", model_ref)

    @property
    def queues(self) -> str:
        """SET of model refs that have a queue: every ref with waiting or leased items, and the latest
        version of each model that had one (a reaper pass prunes an older version's empty queue,
        `queues.prune_old_queues`, so the set, read before every batch choice, does not grow with
        every version ever registered)."""
        return self._key("queues")

    @property
    def queues_version(self) -> str:
        """STRING counter that moves whenever `queues` gains or loses a ref, so that a process keeping
        the set knows when to read it again (its size alone would miss one ref pruned, another added)."""
        return self._key("queues-version")

    def retrying(self, model_ref: str) -> str:
        """ZSET item id -> when it may run again, of `model_ref`'s items parked in `inflight` while they
        wait out a retry's backoff (`broker/failures/retries.py`); the reaper tells them from lost leases by it."""
        return self._key("retrying", model_ref)

    @property
    def items(self) -> str:
        """HASH item id -> JSON payload of every queued or in-flight item."""
        return self._key("items")

    @property
    def attempts(self) -> str:
        """HASH item id -> how many times it was leased (stops a poison batch looping forever)."""
        return self._key("attempts")

    @property
    def dead(self) -> str:
        """ZSET item id -> time, items that used up their attempts and await failing their job."""
        return self._key("dead")

    # --- batch tickets ----------------------------------------------------
    @property
    def tickets(self) -> str:
        """ZSET ticket id -> last time its drain task was seen (circulating Celery wake-ups)."""
        return self._key("tickets")

    @property
    def ticket_seq(self) -> str:
        """STRING counter for new ticket ids."""
        return self._key("ticket-seq")

    @property
    def doorbell(self) -> str:
        """LIST rung (pushed, trimmed short) on every enqueue; an idle drain task blocks on it while it lingers."""
        return self._key("doorbell")

    # --- jobs ---------------------------------------------------------------
    def job(self, job_id: str) -> str:
        """HASH of one job's fields and checkpoint."""
        return self._key("job", job_id)

    @property
    def output_dirs(self) -> str:
        """HASH output folder path -> id of the job that last claimed it (`output_dirs.claim_output_dir`)."""
        return self._key("output-dirs")

    def job_done(self, job_id: str) -> str:
        """SET of chunk indexes whose outputs are written and acknowledged."""
        return self._key("job", job_id, "done")

    def job_cuts(self, job_id: str) -> str:
        """HASH chunk index -> 'start,stop' of a job's chunks split at run time (`broker/jobs/cuts.py`)."""
        return self._key("job", job_id, "cuts")

    @property
    def jobs(self) -> str:
        """ZSET job id -> creation time, the index behind `GET /v1/jobs`."""
        return self._key("jobs")

    @property
    def jobs_active(self) -> str:
        """ZSET job id -> its chunks' queue score, of jobs queued or running since their last submit or
        resume: the work deadline admission counts ahead of a new job (`broker/sla/figures.py`). Entries
        of jobs that ended are dropped when admission reads them."""
        return self._key("jobs-active")

    @property
    def admission_calibration(self) -> str:
        """HASH model version (content hash) -> how much longer its jobs ran than its profile foresaw, lately,
        and '<version>|jobs' -> how many jobs taught it; deadline admission multiplies that model's
        predicted device time by it (`broker/sla/figures.py`, `drop_ended`)."""
        return self._key("admission-calibration")

    @property
    def sla_model(self) -> str:
        """HASH `weights` (JSON), `jobs`, `updated_at`: the SLA violation predictor's weights, learnt from the
        jobs with a deadline that ended (`broker/sla/watch.py`)."""
        return self._key("sla-model")

    @property
    def jobs_filling(self) -> str:
        """ZSET job id -> time of its last enqueue call, for jobs whose items are still being queued in
        slices (`broker.jobs.slices.ENQUEUE_SLICE`); a reaper pass completes a fill whose caller died."""
        return self._key("jobs-filling")

    @property
    def jobs_stopping(self) -> str:
        """ZSET job id -> time of its stop's last call, for jobs whose items are still being taken out in
        slices by a cancel or fail (`broker.jobs.stops.stop_job`); a reaper pass completes a stop whose caller died."""
        return self._key("jobs-stopping")

    @property
    def jobs_due(self) -> str:
        """ZSET job id -> deadline (unix seconds), of the active jobs with a deadline: the jobs whose risk of
        missing it /metrics reports (`broker.monitoring.sla_metrics`). A job enters at submit and resume, and leaves
        when it ends (`lib.lua` `count_job_end`)."""
        return self._key("jobs-due")

    def owner_jobs(self, tenant: str, owner: str) -> str:
        """ZSET job id -> creation time of the jobs one API key name submitted for one tenant (`GET /v1/jobs?owner=`):
        a key name is its tenant's, so two tenants' keys of one name have an index each."""
        return self._key("jobs-of-owner", tenant, owner)

    def names_jobs(self, owner: str) -> str:
        """ZSET the jobs of one key name of whichever tenant, as releases kept them before key names were their
        tenant's; each is deleted by the `index_job_owners` pass that puts its jobs in `owner_jobs`."""
        return self._key("jobs-of", owner)

    @property
    def owner_index_built(self) -> str:
        """STRING present once every job stored before `owner_jobs` existed has been added to its owner's."""
        return self._key("jobs-of-owner-built")

    @property
    def owner_index_mark(self) -> str:
        """STRING id of the last job, in `jobs` index order, that `broker.jobs.lists.index_job_owners` has indexed."""
        return self._key("jobs-of-owner-mark")

    def jobs_of_tenant(self, tenant: str) -> str:
        """ZSET job id -> creation time of every job of one tenant, kept as long as the job (what its
        tenant-admin and viewer keys list); `tenant_jobs` holds only its active ones."""
        return self._key("jobs-of-tenant", tenant)

    @property
    def tenant_index_built(self) -> str:
        """STRING present once every job stored before `jobs_of_tenant` existed has been added to its tenant's."""
        return self._key("jobs-of-tenant-built")

    @property
    def tenant_index_mark(self) -> str:
        """STRING id of the last job, in `jobs` index order, that `broker.jobs.lists.index_job_tenants` has indexed."""
        return self._key("jobs-of-tenant-mark")

    @property
    def job_counts(self) -> str:
        """HASH status -> how many jobs are in it, kept by every script that changes a job's status
        (`lib.lua` `count_job_move`), for the jobs whose hash is marked `counted`."""
        return self._key("job-counts")

    @property
    def job_counts_mark(self) -> str:
        """STRING id of the last job, in `jobs` index order, that `broker.jobs.lists.count_old_jobs` has looked at."""
        return self._key("job-counts-mark")

    @property
    def job_counts_built(self) -> str:
        """STRING present once every job stored before `job_counts` existed has been counted in it."""
        return self._key("job-counts-built")

    @property
    def counters(self) -> str:
        """HASH '<what>:<model ref>' -> running total for /metrics: requests completed by status
        (`requests_succeeded:`, `requests_failed:`, `requests_expired:`), job rows done (`job_rows:`), jobs'
        deadlines met or missed (`job_deadline_met:`, `job_deadline_missed:`), online requests' deadlines met or
        missed (`request_deadline_met:`, `request_deadline_missed:`), jobs refused by deadline admission
        (`admission_rejected:`), failures by class, retried or not (`failures_retried_<class>:`,
        `failures_final_<class>:`), and waiting items the beat's re-scoring moved (`rescore_moved_<reason>:`)."""
        return self._key("counters")

    @property
    def model_stats(self) -> str:
        """HASH '<model ref>|<stat>' -> running total of a model version's online requests, for the v2
        statistics extension (`broker.monitoring.model_stats`): counts, nanoseconds, runs by batch size."""
        return self._key("model-stats")

    @property
    def model_batch_stats(self) -> str:
        """HASH '<model ref>|<rows>_count' / '<model ref>|<rows>_ns' -> a model version's online runs of that
        many rows and their time, for the v2 statistics' `batch_stats` (apart from `model_stats`, which
        every /metrics scrape reads: these grow with the batch sizes run)."""
        return self._key("model-batch-stats")

    @property
    def latency_buckets(self) -> str:
        """HASH '<model ref>|<what>|<priority class>|<bucket>' -> observations in that bucket, and
        '...|ns' -> their sum in nanoseconds: the latency histograms of /metrics (`broker.monitoring.sla_metrics`),
        kept by the scripts that complete requests, acknowledge chunks and end jobs. What: `request` (submit
        to result), `queue` (submit to run start), `run` (the run a request was in), `chunk` (a job chunk's
        run), `job` (a job's submit to its success). Named for its bounds: buckets are numbered, so a new
        bound takes a new name and the old HASH is left unread."""
        return self._key("latency-buckets-1ms")

    @property
    def batch_sizes(self) -> str:
        """HASH '<model ref>|<rows or tokens>|<bucket>' -> runs of that size, and '...|sum' -> their rows or
        tokens: the batch size histograms of /metrics (`broker.monitoring.batch_sizes`), added to by each
        worker's heartbeat from what it counted since the last."""
        return self._key("batch-sizes")

    @property
    def http_requests(self) -> str:
        """HASH of the API's HTTP answers, by route, method and status, and their time's histogram buckets
        (`broker.monitoring.http_stats`), added to by each API process every second or so."""
        return self._key("http-requests")

    # --- online requests ---------------------------------------------------
    def request(self, request_id: str) -> str:
        """HASH of one online request: fields, inputs until it runs, then outputs."""
        return self._key("req", request_id)

    def inbox(self, name: str) -> str:
        """LIST of the finished requests an API process waits for: one waiter thread there blocks on it for
        all of them (`sits_api/intake/result_inbox.py`), instead of one blocking call per request."""
        return self._key("inbox", name)

    def waiting_requests(self, model_ref: str) -> str:
        """ZSET request id -> its priority level as submitted, of `model_ref`'s online requests waiting in
        its ready queue (not leased): what `max_queue_size` counts, in total (ZCARD) and per level (ZCOUNT).
        Every script that moves a request into or out of the ready queue keeps it. Its name is also the
        channel a request that starts waiting is announced on (`sits_worker/serving/request_bell.py`)."""
        return self._key("waiting-requests", model_ref)

    def tenants_served(self, model_ref: str) -> str:
        """HASH tenant -> when one of its online requests of `model_ref` was last answered after a run, and
        `<tenant>|leased` -> until when its batch leased under a share split keeps it present (ahead of now
        while it runs; its answer takes it back): how a lease tells a tenant present on the model between its
        requests (`broker/tenants/batch_shares.py`). Kept an hour after its last write."""
        return self._key("tenants-served", model_ref)

    def request_timeouts(self, model_ref: str) -> str:
        """ZSET request id -> when its timeout passes (unix seconds), of `model_ref`'s requests that have
        one (`broker.online.timeouts`); an entry whose request is gone leaves at the next pass."""
        return self._key("request-timeouts", model_ref)

    def deadlines(self, model_ref: str) -> str:
        """ZSET item id -> deadline (unix seconds) of `model_ref`'s waiting items that have one (PSA index)."""
        return self._key("deadlines", model_ref)

    @property
    def policy(self) -> str:
        """STRING JSON of the live scoring weights and ordering (hot-updated by `PUT /v1/policy`)."""
        return self._key("policy")

    @property
    def rescore_marks(self) -> str:
        """HASH model ref -> JSON {fingerprint, walk_until, settled}: the profile the beat's re-scoring last
        walked a queue for, and whether it walks it again (`broker/queueing/re_estimate.py`)."""
        return self._key("rescore-marks")

    @property
    def routes(self) -> str:
        """HASH model name -> JSON A/B route of its bare name (`broker/models/routing.py`, `PUT /v1/routes`)."""
        return self._key("routes")

    # --- tenants -------------------------------------------------------------
    @property
    def tenants(self) -> str:
        """HASH tenant name -> JSON record: share, limit, quotas (`broker/tenants/records.py`, `PUT /v1/tenants`)."""
        return self._key("tenants")

    @property
    def tenant_usage(self) -> str:
        """HASH tenant name -> JSON {value, at}: its decayed device-seconds, which fair share ranks by."""
        return self._key("tenant-usage")

    @property
    def usage_tenants(self) -> str:
        """ZSET tenant name -> last day (unix day number) it was billed for: who `GET /v1/usage` lists."""
        return self._key("usage-tenants")

    def tenant_bill(self, tenant: str, day: int) -> str:
        """HASH of one tenant's chargeback for one UTC day (unix day number): totals and per model, key and
        device kind (`broker/tenants/usage.py`)."""
        return self._key("bill", tenant, str(day))

    def usage_report_hold(self, tenant: str) -> str:
        """STRING hold token, present while one of the tenant's usage reports of whole bills runs or rests
        (`broker/tenants/usage.py`, `one_report_at_a_time`)."""
        return self._key("usage-report-hold", tenant)

    def tenant_queued(self, tenant: str) -> str:
        """ZSET request id -> when its record expires: the tenant's online requests not answered yet
        (`max_queued`)."""
        return self._key("tenant-queued", tenant)

    def tenant_queued_bytes(self, tenant: str) -> str:
        """HASH entry -> bytes, and `total` -> their sum: what the tenant's online requests hold in Redis against
        its `max_queued_bytes`: the inputs of those not answered yet (under the request id, leaving with its
        `tenant_queued` entry), then the results kept of those answered (`tenant_kept`)."""
        return self._key("tenant-queued-bytes", tenant)

    def tenant_kept(self, tenant: str) -> str:
        """ZSET entry -> when it expires: the tenant's answered requests' kept results that its
        `tenant_queued_bytes` counts (under the request id: its hash; `<id>|inbox`: the copy pushed to its
        waiter's inbox), freed by its next submit after then."""
        return self._key("tenant-kept", tenant)

    def tenant_jobs(self, tenant: str) -> str:
        """ZSET job id -> when its place was taken: the tenant's jobs queued or running (`max_inflight`)."""
        return self._key("tenant-jobs", tenant)

    def tenant_job_chunks(self, tenant: str) -> str:
        """HASH job id -> its chunks, for the jobs of `tenant_jobs` (`max_queued_chunks`); dropped with their place."""
        return self._key("tenant-job-chunks", tenant)

    # --- models, workers, keys --------------------------------------------
    @property
    def model_versions(self) -> str:
        """HASH "name@version" -> JSON model record."""
        return self._key("model-versions")

    @property
    def model_latest(self) -> str:
        """HASH name -> newest registered version."""
        return self._key("model-latest")

    @property
    def model_owners(self) -> str:
        """HASH model name -> the tenant whose key registered it first (`registry`)."""
        return self._key("model-owners")

    @property
    def model_repository(self) -> str:
        """HASH model name -> JSON state of a model of a Triton model repository: READY, UNAVAILABLE with its
        reason, or UNLOADED, and its loaded versions (`broker/models/repository.py`)."""
        return self._key("model-repository")

    @property
    def model_repository_lock(self) -> str:
        """STRING present while one API process loads the model repository at its start (the others skip it)."""
        return self._key("model-repository-lock")

    def registration(self, registration_id: str) -> str:
        """HASH of one model registration run off the API's request threads: its status, and the version or
        the error it ended with (`sits_api.intake.registrations`); expires an hour after it ends."""
        return self._key("registration", registration_id)

    @property
    def model_owners_by_tenant(self) -> str:
        """STRING, set once `model-owners` holds tenants rather than key names (`registry.own_names_by_tenant`)."""
        return self._key("model-owners-by-tenant")

    @property
    def live_batching(self) -> str:
        """HASH model ref -> JSON batching that overrides the model version's own for a while: a tuning
        sweep's trial settings or the batching controller's (`broker/tuning/live.py`)."""
        return self._key("live-batching")

    def answered_latencies(self, model_ref: str) -> str:
        """LIST of '<answered at> <latency s> <batch rows>' of `model_ref`'s answered requests, newest first,
        capped, for the batching controller (`broker/tuning/windows.py`)."""
        return self._key("answered-latencies", model_ref)

    @property
    def controllers(self) -> str:
        """HASH '<model ref>|<device kind>' -> JSON state of the batching controller of that model version on
        that kind of device, with the queue length it last saw (`broker/tuning/steering.py`)."""
        return self._key("batching-controllers")

    @property
    def weight_learner(self) -> str:
        """STRING JSON state of the CP-Score weight learner (`broker/tuning/learning.py`)."""
        return self._key("weight-learner")

    @property
    def batching_changes(self) -> str:
        """LIST of JSON changes the batching controller made, newest first, capped (`broker/tuning/steering.py`)."""
        return self._key("batching-changes")

    def sweep_seconds(self, tenant: str, day: str) -> str:
        """STRING the seconds of tuning sweeps `tenant` planned on UTC `day` (YYYY-MM-DD), kept two days
        (`tuning.tenant_sweep_seconds`)."""
        return self._key("sweep-seconds", tenant, day)

    @property
    def tunings(self) -> str:
        """HASH '<model ref>|<device kind>' -> JSON result of the model version's last tuning sweep on that
        kind of device (`broker/tuning/results.py`)."""
        return self._key("tunings")

    @property
    def workers(self) -> str:
        """HASH worker name -> JSON heartbeat (device, streams, pid, last_heartbeat)."""
        return self._key("workers")

    @property
    def breakers(self) -> str:
        """HASH '<model ref>|<worker name>' -> JSON circuit breaker of that model version on that worker
        (`broker/failures/breaker.py`): its state and the window's run counts; only that worker writes it."""
        return self._key("breakers")

    @property
    def reaper_turn(self) -> str:
        """STRING name of the worker whose reaper thread passes now; it renews it at every tick, and
        another worker takes it once it has expired (`take_reaper_turn.lua`)."""
        return self._key("reaper-turn")

    @property
    def api_keys(self) -> str:
        """HASH sha256(key) -> JSON {name, role, tenant, group}: every key, looked up by its digest."""
        return self._key("api-keys")

    def tenant_api_keys(self, tenant: str) -> str:
        """SET of the digests of one tenant's member keys (tenant-admin, user, viewer), so that a tenant's key
        changes read its own keys alone (`broker/tenants/apikeys.py`)."""
        return self._key("api-keys-of", tenant)

    @property
    def tenantless_api_keys(self) -> str:
        """SET of the digests of the admin and metrics keys, which are no tenant's members."""
        return self._key("api-keys-tenantless")

    @property
    def api_keys_indexed(self) -> str:
        """STRING how many keys of `api_keys` the per-tenant sets hold: other than `api_keys`' length, the sets
        are built again from it (keys written before the sets existed, or by an older API process)."""
        return self._key("api-keys-indexed")

    @property
    def api_keys_checked(self) -> str:
        """STRING present (with an expiry) while the per-tenant key sets count as checked: once it has expired,
        the next key change builds them again from `api_keys` (`apikeys.KEY_SETS_CHECKED_SECONDS`)."""
        return self._key("api-keys-checked")

    @property
    def replicated_mark(self) -> str:
        """STRING the time of the last write the API waited for replicas to hold (`Store.wait_for_replicas`):
        written on the waiting thread's own connection, so that Redis's WAIT counts every write before it."""
        return self._key("replicated-mark")

    # --- schedules (broker/schedules) ----------------------------------------------------------
    # A schedule is named by its member, 'tenant|name'; a run by 'tenant|name|slot'.
    @property
    def schedules(self) -> str:
        """HASH member -> JSON schedule (`broker/schedules/records.py`)."""
        return self._key("schedules")

    @property
    def schedule_cursors(self) -> str:
        """HASH member -> the last slot decided (released, held or missed): `claim_slot.lua` claims only
        later ones."""
        return self._key("schedule-cursors")

    @property
    def schedules_due(self) -> str:
        """ZSET member -> when the beat next looks at the schedule (its next slot's due time); paused ones
        are not in it."""
        return self._key("schedules-due")

    def schedule_runs(self, member: str) -> str:
        """HASH slot -> JSON run of one schedule (`records.Run`), its `beat.runs_kept` latest."""
        return self._key("schedule-runs", member)

    def schedule_run_slots(self, member: str) -> str:
        """ZSET slot -> slot, the runs in `schedule_runs(member)` in order: how the oldest are dropped."""
        return self._key("schedule-run-slots", member)

    @property
    def schedule_runs_releasing(self) -> str:
        """ZSET 'member|slot' -> when its release was last sent: runs claimed whose job is not made yet."""
        return self._key("schedule-runs-releasing")

    @property
    def schedule_runs_held(self) -> str:
        """ZSET 'member|slot' -> when the beat looks at it again: runs held by the steps they come after."""
        return self._key("schedule-runs-held")

    @property
    def schedule_stats(self) -> str:
        """HASH 'member|<what>' -> running total for /metrics (`broker/schedules/stats.py`)."""
        return self._key("schedule-stats")

    @property
    def beat_turn(self) -> str:
        """STRING the id of the beat that releases schedules now; it renews it at every pass
        (`take_reaper_turn.lua`)."""
        return self._key("beat-turn")

    def release_lease(self, run: str) -> str:
        """STRING present while one releaser makes the job of run 'member|slot' (`beat.release_timeout`)."""
        return self._key("release-lease", run)

    def tenant_releases(self, tenant: str) -> str:
        """ZSET release 'member|slot#hold token' -> until when its releaser holds one of the tenant's places
        (`beat.releases_per_tenant`, `broker/schedules/release_places.py`), renewed while it works."""
        return self._key("tenant-releases", tenant)

    def release_tries(self, run: str) -> str:
        """STRING counter of the releases of run 'member|slot' that Redis or the input failed for a while
        (`release.RELEASE_TRIES`)."""
        return self._key("release-tries", run)
