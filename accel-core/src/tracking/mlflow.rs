//! MLflow as a tracker, over its REST API (`/api/2.0/mlflow/...`): no Python at run time.
//!
//! As Accelerate's `MLflowTracker` with MLflow's own client: the server is
//! `MLFLOW_TRACKING_URI`; the experiment is `MLFLOW_EXPERIMENT_NAME`, else the project name,
//! created when missing; `MLFLOW_RUN_ID` continues a run, `MLFLOW_TAGS` (a JSON object) tags
//! it. The hyperparameters become params (100 per request; a value over 6,000 characters is
//! dropped with a warning, as Accelerate drops it), each `log` one metric point per value at
//! its step, and the end of training the run's status: FINISHED, or FAILED when the run
//! ends by an error (or the tracker is dropped unfinished). Metric points go in batches of
//! up to 1,000, at most a second apart, and at the end.
//!
//! Requests are bounded: each by `MLFLOW_HTTP_REQUEST_TIMEOUT` seconds (default 120, as
//! MLflow's), retried `MLFLOW_HTTP_REQUEST_MAX_RETRIES` times (default 3; 1, 2, 4 s apart)
//! when the server cannot be reached or answers 429/5xx, as MLflow's client retries them.
//! Credentials as MLflow reads them: `MLFLOW_TRACKING_TOKEN` (bearer), or
//! `MLFLOW_TRACKING_USERNAME` and `MLFLOW_TRACKING_PASSWORD` (basic). `https://` servers
//! need accel-core's `https` feature; file, sqlite and databricks URIs are refused, since
//! only a server speaks REST.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::Engine;
use serde_json::{Value, json};

use std::path::Path;

use super::{Tracker, Value as Logged};
use crate::error::{Error, Result};

/// MLflow's limits on one `runs/log-batch` request and on a param's value.
const MAX_METRICS_PER_BATCH: usize = 1000;
const MAX_PARAMS_PER_BATCH: usize = 100;
const MAX_PARAM_VALUE_LEN: usize = 6000;
/// Metric points wait at most this long for a batch.
const FLUSH_EVERY: Duration = Duration::from_secs(1);

/// Where and how to reach the server, and which run to write: from the environment
/// ([`MlFlowSettings::from_env`]) or set by hand.
#[derive(Debug, Clone, PartialEq)]
pub struct MlFlowSettings {
    /// The server, `http://host:port` (`MLFLOW_TRACKING_URI`).
    pub tracking_uri: String,
    /// The experiment, created when missing (`MLFLOW_EXPERIMENT_NAME`, else the project).
    pub experiment_name: String,
    /// Continue this run instead of creating one (`MLFLOW_RUN_ID`).
    pub run_id: Option<String>,
    /// The new run's name (`MLFLOW_RUN_NAME`; the server picks one when unset).
    pub run_name: Option<String>,
    /// Tags set on the run (`MLFLOW_TAGS`, a JSON object), besides `mlflow.user` and
    /// `mlflow.source.*`.
    pub tags: Vec<(String, String)>,
    /// The `Authorization` header's value, if any.
    pub authorization: Option<String>,
    /// Each request's limit (`MLFLOW_HTTP_REQUEST_TIMEOUT`, seconds).
    pub timeout: Duration,
    /// Retries of a request the server could not take (`MLFLOW_HTTP_REQUEST_MAX_RETRIES`).
    pub retries: u32,
}

impl MlFlowSettings {
    /// The settings MLflow's own clients read from the environment, with `project` as the
    /// experiment when `MLFLOW_EXPERIMENT_NAME` is unset.
    pub fn from_env(project: &str) -> Result<Self> {
        Self::from_env_with(project, |k| std::env::var(k).ok())
    }

    /// [`from_env`](Self::from_env) reading variables through `get`.
    pub fn from_env_with(project: &str, get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let get = |k: &str| get(k).map(|v| v.trim().to_owned()).filter(|v| !v.is_empty());
        let bad = |what: String| Error::Config(format!("log_with mlflow: {what}"));
        let Some(tracking_uri) = get("MLFLOW_TRACKING_URI") else {
            return Err(bad("MLFLOW_TRACKING_URI is not set: name the tracking server, e.g. \
                 MLFLOW_TRACKING_URI=http://127.0.0.1:5000 (started with `mlflow server \
                 --backend-store-uri sqlite:///mlflow.db --port 5000`); accel speaks MLflow's \
                 REST API, so a server is needed"
                .into()));
        };
        let tracking_uri = check_uri(&tracking_uri).map_err(bad)?;
        let tags = match get("MLFLOW_TAGS") {
            None => Vec::new(),
            Some(text) => match serde_json::from_str::<Value>(&text) {
                Ok(Value::Object(map)) => {
                    map.into_iter().map(|(k, v)| (k, param_text(&v))).collect()
                }
                _ => {
                    return Err(bad(format!(
                        "MLFLOW_TAGS={text:?} is not a JSON object such as {{\"team\": \"nlp\"}}"
                    )));
                }
            },
        };
        let number = |var: &str, default: u64| -> Result<u64> {
            match get(var) {
                None => Ok(default),
                Some(v) => v.parse().map_err(|_| bad(format!("{var}={v:?} is not a whole number"))),
            }
        };
        let authorization = match (
            get("MLFLOW_TRACKING_TOKEN"),
            get("MLFLOW_TRACKING_USERNAME"),
            get("MLFLOW_TRACKING_PASSWORD"),
        ) {
            (Some(token), _, _) => Some(format!("Bearer {token}")),
            (None, Some(user), password) => {
                let pair = format!("{user}:{}", password.unwrap_or_default());
                Some(format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(pair)))
            }
            _ => None,
        };
        Ok(Self {
            tracking_uri,
            experiment_name: get("MLFLOW_EXPERIMENT_NAME").unwrap_or_else(|| project.to_owned()),
            run_id: get("MLFLOW_RUN_ID"),
            run_name: get("MLFLOW_RUN_NAME"),
            tags,
            authorization,
            timeout: Duration::from_secs(number("MLFLOW_HTTP_REQUEST_TIMEOUT", 120)?.max(1)),
            retries: number("MLFLOW_HTTP_REQUEST_MAX_RETRIES", 3)? as u32,
        })
    }
}

/// The server's base URI, or why it cannot be one.
fn check_uri(uri: &str) -> std::result::Result<String, String> {
    let uri = uri.trim_end_matches('/');
    if uri.starts_with("http://") {
        return Ok(uri.to_owned());
    }
    if uri.starts_with("https://") {
        if cfg!(feature = "https") {
            return Ok(uri.to_owned());
        }
        return Err(format!(
            "MLFLOW_TRACKING_URI={uri}: https needs accel-core's `https` feature (rustls); \
             build with `--features accel-core/https`, or reach the server over http"
        ));
    }
    Err(format!(
        "MLFLOW_TRACKING_URI={uri}: accel writes to an MLflow tracking server over REST \
         (http://host:port); local stores (a path, file:, sqlite:) and databricks are MLflow's \
         Python client's only — serve one with `mlflow server --backend-store-uri {uri}`"
    ))
}

/// A param's or tag's text: strings as they are, everything else as JSON.
fn param_text(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// A metric value as MLflow's JSON takes it (protobuf's JSON mapping spells the
/// non-finite ones as strings).
fn metric_value(v: f64) -> Value {
    if v.is_nan() {
        json!("NaN")
    } else if v.is_infinite() {
        json!(if v > 0.0 { "Infinity" } else { "-Infinity" })
    } else {
        json!(v)
    }
}

/// This process's user's name from the password database.
fn login_name() -> Option<String> {
    let mut buf = vec![0 as libc::c_char; 4096];
    // SAFETY: `pwd` and `buf` outlive the call, which writes at most `buf.len()` bytes into
    // `buf` and points `pwd`'s strings (and `found`) into them.
    unsafe {
        let mut pwd: libc::passwd = std::mem::zeroed();
        let mut found: *mut libc::passwd = std::ptr::null_mut();
        let rc =
            libc::getpwuid_r(libc::getuid(), &mut pwd, buf.as_mut_ptr(), buf.len(), &mut found);
        if rc != 0 || found.is_null() || pwd.pw_name.is_null() {
            return None;
        }
        std::ffi::CStr::from_ptr(pwd.pw_name).to_str().ok().map(str::to_owned)
    }
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// The REST client: one connection pool, bounded requests, retries.
#[derive(Debug)]
struct Client {
    base: String,
    agent: ureq::Agent,
    authorization: Option<String>,
    retries: u32,
}

impl Client {
    fn new(settings: &MlFlowSettings) -> Self {
        let agent = ureq::Agent::config_builder()
            .timeout_global(Some(settings.timeout))
            .http_status_as_error(false)
            .build()
            .into();
        Self {
            base: settings.tracking_uri.clone(),
            agent,
            authorization: settings.authorization.clone(),
            retries: settings.retries,
        }
    }

    /// `GET` (with `query`) or `POST` (with `body`) of `/api/2.0/mlflow/{endpoint}`: the
    /// answer's JSON, or an error naming the server, the call and what it said. `Ok(None)`
    /// for a 404 `RESOURCE_DOES_NOT_EXIST`.
    fn call(
        &self,
        endpoint: &str,
        query: &[(&str, &str)],
        body: Option<&Value>,
    ) -> Result<Option<Value>> {
        let url = format!("{}/api/2.0/mlflow/{endpoint}", self.base);
        let mut attempt = 0;
        loop {
            let sent = match body {
                Some(body) => {
                    let mut request =
                        self.agent.post(&url).header("Content-Type", "application/json");
                    if let Some(auth) = &self.authorization {
                        request = request.header("Authorization", auth);
                    }
                    request.send(body.to_string())
                }
                None => {
                    let mut request = self.agent.get(&url);
                    for (k, v) in query {
                        request = request.query(*k, *v);
                    }
                    if let Some(auth) = &self.authorization {
                        request = request.header("Authorization", auth);
                    }
                    request.call()
                }
            };
            let retry_after = |attempt: u32| Duration::from_secs(1 << attempt.min(5));
            let failure = match sent {
                Ok(mut response) => {
                    let status = response.status().as_u16();
                    let text = response.body_mut().read_to_string().unwrap_or_default();
                    if (200..300).contains(&status) {
                        let value = serde_json::from_str(&text).map_err(|e| {
                            self.error(endpoint, format!("answered {status} with no JSON ({e})"))
                        })?;
                        return Ok(Some(value));
                    }
                    if status == 404 && text.contains("RESOURCE_DOES_NOT_EXIST") {
                        return Ok(None);
                    }
                    let said = serde_json::from_str::<Value>(&text)
                        .ok()
                        .and_then(|v| v.get("message").and_then(Value::as_str).map(str::to_owned))
                        .unwrap_or_else(|| text.chars().take(300).collect());
                    let message = format!("answered {status}: {said}");
                    if status == 429 || (500..600).contains(&status) {
                        message
                    } else {
                        return Err(self.error(endpoint, message));
                    }
                }
                Err(
                    e @ (ureq::Error::Io(_)
                    | ureq::Error::ConnectionFailed
                    | ureq::Error::HostNotFound),
                ) => {
                    format!(
                        "could not be reached ({e}); is the server running (`mlflow server`) \
                         and MLFLOW_TRACKING_URI right?"
                    )
                }
                Err(e) => return Err(self.error(endpoint, e.to_string())),
            };
            if attempt >= self.retries {
                let tries = attempt + 1;
                return Err(self.error(endpoint, format!("{failure} (after {tries} tries)")));
            }
            std::thread::sleep(retry_after(attempt));
            attempt += 1;
        }
    }

    /// Uploads `bytes` to the artifact proxy (`mlflow server --serve-artifacts`, the default)
    /// at `path` (the run's `mlflow-artifacts:` location without the scheme, then the
    /// artifact's path), as MLflow's client does for such runs.
    fn put_artifact(&self, path: &str, bytes: &[u8]) -> Result<()> {
        let url = format!("{}/api/2.0/mlflow-artifacts/artifacts/{path}", self.base);
        let mut request = self.agent.put(&url);
        if let Some(auth) = &self.authorization {
            request = request.header("Authorization", auth);
        }
        match request.send(bytes) {
            Ok(response) if (200..300).contains(&response.status().as_u16()) => Ok(()),
            Ok(mut response) => {
                let status = response.status().as_u16();
                let text = response.body_mut().read_to_string().unwrap_or_default();
                let said: String = text.chars().take(300).collect();
                Err(self.error("mlflow-artifacts", format!("answered {status}: {said}")))
            }
            Err(e) => Err(self.error("mlflow-artifacts", e.to_string())),
        }
    }

    fn post(&self, endpoint: &str, body: Value) -> Result<Value> {
        self.call(endpoint, &[], Some(&body))?
            .ok_or_else(|| self.error(endpoint, "answered 404 (no such resource)".into()))
    }

    fn error(&self, endpoint: &str, what: String) -> Error {
        Error::Tracker(format!("MLflow at {} ({endpoint}) {what}", self.base))
    }
}

/// A run on an MLflow tracking server (`log_with = "mlflow"`). On the main process only, as
/// every tracker.
#[derive(Debug)]
pub struct MlFlow {
    client: Client,
    run_id: String,
    experiment_id: String,
    /// Where the run's artifacts go (`mlflow-artifacts:/...` or a folder).
    artifact_uri: String,
    /// The tables logged so far (the `mlflow.loggedArtifacts` tag lists them).
    tables: Vec<String>,
    /// Metric points not sent yet.
    pending: Vec<Value>,
    last_sent: Instant,
    ended: bool,
}

impl MlFlow {
    /// Starts (or, with `run_id`, continues) a run in the experiment of `settings`, creating
    /// the experiment if it does not exist yet.
    pub fn start(settings: &MlFlowSettings) -> Result<Self> {
        let client = Client::new(settings);
        let name = settings.experiment_name.as_str();
        let experiment_id =
            match client.call("experiments/get-by-name", &[("experiment_name", name)], None)? {
                Some(found) => found["experiment"]["experiment_id"].as_str().map(str::to_owned),
                None => client
                    .post("experiments/create", json!({ "name": name }))?
                    .get("experiment_id")
                    .and_then(Value::as_str)
                    .map(str::to_owned),
            }
            .ok_or_else(|| {
                client.error("experiments", format!("gave no id for experiment `{name}`"))
            })?;
        // As MLflow's `getpass.getuser()`: the login variables, then the password database.
        let user = ["LOGNAME", "USER", "LNAME", "USERNAME"]
            .iter()
            .find_map(|k| std::env::var(k).ok().filter(|v| !v.is_empty()))
            .or_else(login_name)
            .unwrap_or_default();
        let mut tags = settings.tags.clone();
        let source = std::env::current_exe()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|_| "accel".into());
        for (key, value) in [
            ("mlflow.user", user.clone()),
            ("mlflow.source.name", source),
            ("mlflow.source.type", "LOCAL".into()),
        ] {
            if !tags.iter().any(|(k, _)| k == key) {
                tags.push((key.into(), value));
            }
        }
        let tags: Vec<Value> = tags.iter().map(|(k, v)| json!({ "key": k, "value": v })).collect();
        let (run_id, artifact_uri) = match &settings.run_id {
            Some(run_id) => {
                // As `mlflow.start_run(run_id=..)`: the run is RUNNING again, end time unset.
                client.post("runs/update", json!({ "run_id": run_id, "status": "RUNNING" }))?;
                for chunk in tags.chunks(MAX_PARAMS_PER_BATCH) {
                    client.post("runs/log-batch", json!({ "run_id": run_id, "tags": chunk }))?;
                }
                let found = client
                    .call("runs/get", &[("run_id", run_id)], None)?
                    .ok_or_else(|| client.error("runs/get", format!("has no run {run_id}")))?;
                let uri = found["run"]["info"]["artifact_uri"].as_str().unwrap_or_default();
                (run_id.clone(), uri.to_owned())
            }
            None => {
                let mut body = json!({
                    "experiment_id": experiment_id,
                    "start_time": now_ms(),
                    "user_id": user,
                    "tags": tags,
                });
                if let Some(run_name) = &settings.run_name {
                    body["run_name"] = json!(run_name);
                }
                let created = client.post("runs/create", body)?;
                let run_id = created["run"]["info"]["run_id"]
                    .as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| client.error("runs/create", "gave no run id".into()))?;
                let uri = created["run"]["info"]["artifact_uri"].as_str().unwrap_or_default();
                (run_id, uri.to_owned())
            }
        };
        Ok(Self {
            client,
            run_id,
            experiment_id,
            artifact_uri,
            tables: Vec::new(),
            pending: Vec::new(),
            last_sent: Instant::now(),
            ended: false,
        })
    }

    /// The run's id (to continue it later with `MLFLOW_RUN_ID`).
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// The experiment's id.
    pub fn experiment_id(&self) -> &str {
        &self.experiment_id
    }

    /// Where the run's artifacts are kept (`mlflow-artifacts:/...` behind the server's
    /// proxy, or a folder).
    pub fn artifact_uri(&self) -> &str {
        &self.artifact_uri
    }

    /// Stores `bytes` as the run's artifact `path` (`media/loss.png`): through the server's
    /// artifact proxy, or into the run's artifact folder when the server keeps them in a
    /// folder of this machine (as MLflow's client writes them there). Other stores (S3,
    /// ...) are refused: serve them through the server (`mlflow server --serve-artifacts`).
    pub fn log_artifact(&self, path: &str, bytes: &[u8]) -> Result<()> {
        let uri = self.artifact_uri.as_str();
        if let Some(location) = uri.strip_prefix("mlflow-artifacts:") {
            // `mlflow-artifacts:/1/abc/artifacts` or `mlflow-artifacts://host:port/1/...`.
            let location = match location.strip_prefix("//") {
                Some(rest) => rest.split_once('/').map_or("", |(_, p)| p),
                None => location.trim_start_matches('/'),
            };
            return self.client.put_artifact(&format!("{location}/{path}"), bytes);
        }
        let folder = uri.strip_prefix("file://").unwrap_or(uri);
        if folder.starts_with('/') {
            let file = Path::new(folder).join(path);
            let io = |source| Error::Io { path: file.clone(), source };
            std::fs::create_dir_all(file.parent().expect("in the run's folder")).map_err(io)?;
            return std::fs::write(&file, bytes).map_err(io);
        }
        Err(Error::Tracker(format!(
            "MLflow run {} keeps its artifacts at {uri}, which accel does not write to: serve \
             them through the tracking server (`mlflow server --serve-artifacts \
             --artifacts-destination {uri}`)",
            self.run_id
        )))
    }

    /// Sends the metric points not sent yet.
    pub fn flush(&mut self) -> Result<()> {
        while !self.pending.is_empty() {
            let take = self.pending.len().min(MAX_METRICS_PER_BATCH);
            let batch: Vec<Value> = self.pending.drain(..take).collect();
            self.client
                .post("runs/log-batch", json!({ "run_id": self.run_id, "metrics": batch }))?;
        }
        self.last_sent = Instant::now();
        Ok(())
    }

    /// Sends what is left and sets the run's status and end time.
    fn end(&mut self, status: &str) -> Result<()> {
        if self.ended {
            return Ok(());
        }
        self.ended = true;
        let flushed = self.flush();
        let body = json!({ "run_id": self.run_id, "status": status, "end_time": now_ms() });
        self.client.post("runs/update", body)?;
        flushed
    }
}

impl Tracker for MlFlow {
    fn name(&self) -> &str {
        "mlflow"
    }

    fn store_init_configuration(&mut self, config: &Value) -> Result<()> {
        let entries: Vec<(String, String)> = match config {
            Value::Object(map) => map.iter().map(|(k, v)| (k.clone(), param_text(v))).collect(),
            Value::Null => Vec::new(),
            other => vec![("config".into(), param_text(other))],
        };
        let mut params = Vec::new();
        for (key, value) in entries {
            if value.chars().count() > MAX_PARAM_VALUE_LEN {
                eprintln!(
                    "accel: mlflow: the hyperparameter `{key}` is longer than MLflow's \
                     {MAX_PARAM_VALUE_LEN} characters for a param; it is not logged"
                );
                continue;
            }
            params.push(json!({ "key": key, "value": value }));
        }
        for chunk in params.chunks(MAX_PARAMS_PER_BATCH) {
            self.client
                .post("runs/log-batch", json!({ "run_id": self.run_id, "params": chunk }))?;
        }
        Ok(())
    }

    fn log(&mut self, step: u64, values: &[(&str, f64)]) -> Result<()> {
        let timestamp = now_ms();
        self.pending.extend(values.iter().map(|(key, value)| {
            json!({ "key": key, "value": metric_value(*value), "timestamp": timestamp, "step": step })
        }));
        if self.pending.len() >= MAX_METRICS_PER_BATCH || self.last_sent.elapsed() >= FLUSH_EVERY {
            self.flush()?;
        }
        Ok(())
    }

    /// As MLflow's `log_image`, `log_text` and `log_table`: the artifact
    /// `media/<key>_<step>.png`, `.txt`, or `.json` (`{"columns": [...], "data": [...]}`, the
    /// table listed in the run's `mlflow.loggedArtifacts` tag, as `log_table` does).
    fn log_media(&mut self, step: u64, key: &str, value: &Logged) -> Result<()> {
        let stem = format!("media/{}_{step}", super::media::file_stem(key));
        match value {
            Logged::Scalar(_) => Ok(()),
            Logged::Image(image) => self.log_artifact(&format!("{stem}.png"), &image.png()?),
            Logged::Text(text) => self.log_artifact(&format!("{stem}.txt"), text.as_bytes()),
            Logged::Table(table) => {
                let path = format!("{stem}.json");
                self.log_artifact(&path, table.json().to_string().as_bytes())?;
                self.tables.push(path);
                let listed: Vec<Value> =
                    self.tables.iter().map(|p| json!({ "path": p, "type": "table" })).collect();
                let tag = json!({ "key": "mlflow.loggedArtifacts", "value": Value::from(listed).to_string() });
                self.client
                    .post("runs/log-batch", json!({ "run_id": self.run_id, "tags": [tag] }))?;
                Ok(())
            }
        }
    }

    fn finish(&mut self) -> Result<()> {
        self.end("FINISHED")
    }

    fn fail(&mut self) -> Result<()> {
        self.end("FAILED")
    }
}

impl Drop for MlFlow {
    /// A run never finished ended by an error: say so on the server (best effort).
    fn drop(&mut self) {
        if !self.ended {
            if let Err(e) = self.end("FAILED") {
                eprintln!("accel: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(vars: &[(&str, &str)]) -> Result<MlFlowSettings> {
        MlFlowSettings::from_env_with("digits", |k| {
            vars.iter().find(|(name, _)| *name == k).map(|(_, v)| (*v).to_owned())
        })
    }

    #[test]
    fn settings_are_read_as_mlflow_reads_them_and_bad_ones_are_named() {
        let err = settings(&[]).unwrap_err().to_string();
        assert!(err.contains("MLFLOW_TRACKING_URI is not set"), "{err}");
        let s = settings(&[
            ("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000/"),
            ("MLFLOW_TAGS", r#"{"team": "nlp", "n": 2}"#),
            ("MLFLOW_TRACKING_USERNAME", "ada"),
            ("MLFLOW_TRACKING_PASSWORD", "pw"),
        ])
        .unwrap();
        assert_eq!(s.tracking_uri, "http://127.0.0.1:5000");
        assert_eq!(s.experiment_name, "digits");
        assert_eq!(s.tags, vec![("n".into(), "2".into()), ("team".into(), "nlp".into())]);
        assert_eq!(s.authorization.as_deref(), Some("Basic YWRhOnB3"));
        let s = settings(&[
            ("MLFLOW_TRACKING_URI", "http://h:1"),
            ("MLFLOW_EXPERIMENT_NAME", "exp"),
            ("MLFLOW_TRACKING_TOKEN", "t"),
            ("MLFLOW_RUN_ID", "abc"),
        ])
        .unwrap();
        assert_eq!((s.experiment_name.as_str(), s.run_id.as_deref()), ("exp", Some("abc")));
        assert_eq!(s.authorization.as_deref(), Some("Bearer t"));
        for (uri, says) in [
            ("sqlite:///mlflow.db", "mlflow server --backend-store-uri sqlite:///mlflow.db"),
            ("./mlruns", "over REST"),
            ("databricks", "databricks"),
        ] {
            let err = settings(&[("MLFLOW_TRACKING_URI", uri)]).unwrap_err().to_string();
            assert!(err.contains(says), "{uri}: {err}");
        }
        #[cfg(not(feature = "https"))]
        {
            let err = settings(&[("MLFLOW_TRACKING_URI", "https://h")]).unwrap_err().to_string();
            assert!(err.contains("`https` feature"), "{err}");
        }
        let err = settings(&[("MLFLOW_TRACKING_URI", "http://h"), ("MLFLOW_TAGS", "[1]")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("MLFLOW_TAGS") && err.contains("JSON object"), "{err}");
    }

    #[test]
    fn a_server_that_is_not_there_is_named_within_a_bound() {
        // A port nobody listens on: bound, then closed.
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let mut s =
            settings(&[("MLFLOW_TRACKING_URI", &format!("http://127.0.0.1:{port}"))]).unwrap();
        s.retries = 1;
        let started = Instant::now();
        let err = MlFlow::start(&s).unwrap_err().to_string();
        assert!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
        assert!(
            err.contains(&format!("MLflow at http://127.0.0.1:{port}"))
                && err.contains("experiments/get-by-name")
                && err.contains("could not be reached")
                && err.contains("after 2 tries"),
            "{err}"
        );
    }

    #[test]
    fn non_finite_values_are_spelled_as_mlflow_takes_them() {
        assert_eq!(metric_value(f64::NAN), json!("NaN"));
        assert_eq!(metric_value(f64::NEG_INFINITY), json!("-Infinity"));
        assert_eq!(metric_value(1.5), json!(1.5));
    }
}
