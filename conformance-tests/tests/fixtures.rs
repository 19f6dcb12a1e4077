//! Validates the users' CI kit in `fixtures/` without Docker (which cannot run on this project's
//! machines): parses `docker-compose.yml` and `github-workflow.example.yml` and checks that they
//! would run the whole conformance suite against every backend as written.
//!
//! - every service has a health check and a pinned image (a version tag or a digest; no
//!   `latest`, no missing tag); Redis is started as adapter-redis requires (`appendonly yes`,
//!   `appendfsync always`, `maxmemory-policy noeviction`); there is a PostgreSQL service; Consul's
//!   `session_ttl_min` is at or below the suite's TTL (`CONFORMANCE_TTL_MS`);
//! - the compose header's command and the workflow's conformance step run the `conformance`
//!   runner against every backend, with every variable the suite reads set (the backend URLs of
//!   [`Backend::env_var`], `CI`, `CONFORMANCE_TTL_MS`), each URL on a port the matching service
//!   publishes;
//! - the workflow's workspace-test step sees none of the backend URLs (its tests start their own
//!   servers), the JUnit report is uploaded even on failure, and every job that builds caches
//!   the cargo build.
//!
//! The checks take the files' text, so the unit tests below feed each defect the kit once had
//! and see it reported. `FIXTURES_DIR=<dir>` points the main test at other copies of the two
//! files (for example old revisions).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use conformance_tests::harness::Backend;
use conformance_tests::suite::TTL_ENV;
use yaml_rust2::{Yaml, YamlLoader};

const COMPOSE: &str = "docker-compose.yml";
const WORKFLOW: &str = "github-workflow.example.yml";

/// Environment variables by name.
type Env = BTreeMap<String, String>;

/// Every variable the suite must find set when it runs against the containers.
fn required_vars() -> Vec<&'static str> {
    let mut vars: Vec<&'static str> = Backend::ALL.iter().map(|b| b.env_var()).collect();
    vars.extend(["CI", TTL_ENV]);
    vars
}

/// The image name a service of `backend` runs (the last path segment of the repository).
fn image_name(backend: Backend) -> &'static str {
    match backend {
        Backend::Redis => "redis",
        Backend::Etcd => "etcd",
        Backend::ZooKeeper => "zookeeper",
        Backend::Consul => "consul",
        Backend::Postgres => "postgres",
    }
}

fn load(text: &str, what: &str) -> Result<Yaml, String> {
    let mut docs = YamlLoader::load_from_str(text).map_err(|e| format!("{what}: {e}"))?;
    match docs.len() {
        1 => Ok(docs.remove(0)),
        n => Err(format!("{what}: expected one YAML document, found {n}")),
    }
}

/// A scalar as text (YAML 1.2 reads `true`, `2000` as booleans and integers).
fn scalar(y: &Yaml) -> Option<String> {
    match y {
        Yaml::String(s) | Yaml::Real(s) => Some(s.clone()),
        Yaml::Integer(i) => Some(i.to_string()),
        Yaml::Boolean(b) => Some(b.to_string()),
        _ => None,
    }
}

fn env_map(y: &Yaml) -> Env {
    let mut env = Env::new();
    match y {
        Yaml::Hash(h) => {
            for (k, v) in h {
                if let (Some(k), Some(v)) = (scalar(k), scalar(v)) {
                    env.insert(k, v);
                }
            }
        }
        // Compose also allows `- NAME=value`.
        Yaml::Array(a) => {
            for item in a.iter().filter_map(scalar) {
                if let Some((k, v)) = item.split_once('=') {
                    env.insert(k.to_owned(), v.to_owned());
                }
            }
        }
        _ => {}
    }
    env
}

/// Splits shell text into commands (on newlines, `;`, `&&`, `||`, `|`) of words, honouring
/// quotes and backslash-newline continuations. Enough for the commands of a CI kit.
fn shell_commands(text: &str) -> Vec<Vec<String>> {
    let mut commands = Vec::new();
    let mut words = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut chars = text.chars().peekable();
    let end_word = |words: &mut Vec<String>, word: &mut String, in_word: &mut bool| {
        if *in_word {
            words.push(std::mem::take(word));
            *in_word = false;
        }
    };
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&'\n') => {
                chars.next();
                end_word(&mut words, &mut word, &mut in_word);
            }
            '\\' => {
                if let Some(n) = chars.next() {
                    word.push(n);
                    in_word = true;
                }
            }
            '\'' => {
                in_word = true;
                for n in chars.by_ref() {
                    if n == '\'' {
                        break;
                    }
                    word.push(n);
                }
            }
            '"' => {
                in_word = true;
                while let Some(n) = chars.next() {
                    match n {
                        '"' => break,
                        '\\' => {
                            if let Some(m) = chars.next() {
                                word.push(m);
                            }
                        }
                        _ => word.push(n),
                    }
                }
            }
            '\n' | ';' | '&' | '|' => {
                end_word(&mut words, &mut word, &mut in_word);
                if !words.is_empty() {
                    commands.push(std::mem::take(&mut words));
                }
            }
            c if c.is_whitespace() => end_word(&mut words, &mut word, &mut in_word),
            c => {
                word.push(c);
                in_word = true;
            }
        }
    }
    end_word(&mut words, &mut word, &mut in_word);
    if !words.is_empty() {
        commands.push(words);
    }
    commands
}

fn is_assignment(word: &str) -> bool {
    word.split_once('=').is_some_and(|(k, _)| {
        !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    })
}

/// A run of the `conformance` runner found in shell text.
#[derive(Debug, Default)]
struct Runner {
    /// Variables assigned on the command line or `export`ed before it.
    env: Env,
    /// The runner's own arguments (after `--`).
    args: Vec<String>,
}

impl Runner {
    /// Finds the first command that runs the `conformance` binary.
    fn find(text: &str) -> Option<Runner> {
        let mut exported = Env::new();
        for words in shell_commands(text) {
            if words.first().map(String::as_str) == Some("export") {
                for w in &words[1..] {
                    if let Some((k, v)) = w.split_once('=') {
                        exported.insert(k.to_owned(), v.to_owned());
                    }
                }
                continue;
            }
            let start = words.iter().position(|w| !is_assignment(w)).unwrap_or(0);
            let runs_conformance = words
                .windows(2)
                .any(|p| p[0] == "--bin" && p[1] == "conformance")
                || words.iter().any(|w| w == "--bin=conformance")
                || words
                    .get(start)
                    .is_some_and(|w| w.ends_with("/conformance"));
            if !runs_conformance {
                continue;
            }
            let mut env = exported.clone();
            for w in &words[..start] {
                let (k, v) = w.split_once('=').expect("an assignment");
                env.insert(k.to_owned(), v.to_owned());
            }
            let args = match words.iter().position(|w| w == "--") {
                Some(i) => words[i + 1..].to_vec(),
                None => words[start + 1..].to_vec(),
            };
            return Some(Runner { env, args });
        }
        None
    }

    fn flag(&self, name: &str) -> Option<String> {
        let eq = format!("{name}=");
        self.args.iter().enumerate().find_map(|(i, a)| {
            if a == name {
                self.args.get(i + 1).cloned()
            } else {
                a.strip_prefix(eq.as_str()).map(str::to_owned)
            }
        })
    }

    /// The backends it runs (the runner's default is `memory` alone).
    fn backends(&self) -> Vec<String> {
        self.flag("--backend")
            .map(|b| b.split(',').map(|s| s.trim().to_owned()).collect())
            .unwrap_or_else(|| vec!["memory".into()])
    }

    /// Where it writes JUnit XML: `--junit`, else `CONFORMANCE_JUNIT`.
    fn junit(&self) -> Option<String> {
        self.flag("--junit")
            .or_else(|| self.env.get("CONFORMANCE_JUNIT").cloned())
    }
}

/// `1s`, `500ms`, `2m`, as Go (Consul) writes durations; only the forms a kit would use.
fn go_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit() && c != '.')?;
    let (n, unit) = s.split_at(split);
    let n: f64 = n.parse().ok()?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => return None,
    };
    Some(Duration::from_secs_f64(secs))
}

/// What the compose file offers, for the checks of the commands that use it.
#[derive(Debug, Default)]
struct Compose {
    /// Host ports each backend's service publishes.
    ports: BTreeMap<&'static str, Vec<u16>>,
    /// Consul's `session_ttl_min` (Consul's default, 10 s, when not configured).
    consul_ttl_min: Option<Duration>,
}

fn command_words(service: &Yaml) -> Vec<String> {
    match &service["command"] {
        Yaml::Array(a) => a.iter().filter_map(scalar).collect(),
        y => scalar(y)
            .map(|s| shell_commands(&s).concat())
            .unwrap_or_default(),
    }
}

/// The value of `--flag value` or `--flag=value` in a command.
fn flag_value(words: &[String], flag: &str) -> Option<String> {
    let eq = format!("{flag}=");
    words.iter().enumerate().find_map(|(i, w)| {
        if w == flag {
            words.get(i + 1).cloned()
        } else {
            w.strip_prefix(eq.as_str()).map(str::to_owned)
        }
    })
}

fn published_ports(service: &Yaml) -> Vec<u16> {
    let Some(ports) = service["ports"].as_vec() else {
        return Vec::new();
    };
    ports
        .iter()
        .filter_map(|p| match p {
            Yaml::Hash(_) => scalar(&p["published"]).and_then(|s| s.parse().ok()),
            y => {
                let s = scalar(y)?;
                let parts: Vec<&str> = s.split(':').collect();
                match parts.len() {
                    2 => parts[0].parse().ok(),
                    n if n >= 3 => parts[n - 2].parse().ok(),
                    _ => None,
                }
            }
        })
        .collect()
}

fn consul_session_ttl_min(service: &Yaml) -> Option<Duration> {
    let from_hcl = |hcl: &str| {
        let rest = hcl.split("session_ttl_min").nth(1)?;
        let value = rest
            .trim_start()
            .strip_prefix('=')?
            .trim()
            .trim_matches('"');
        let value = value.split('"').next()?;
        go_duration(value)
    };
    let words = command_words(service);
    let hcl = words.iter().enumerate().find_map(|(i, w)| {
        let value = if w == "-hcl" {
            words.get(i + 1)?.as_str()
        } else {
            w.strip_prefix("-hcl=")?
        };
        from_hcl(value)
    });
    // The image also reads a JSON configuration from CONSUL_LOCAL_CONFIG.
    hcl.or_else(|| {
        let json = env_map(&service["environment"]).remove("CONSUL_LOCAL_CONFIG")?;
        let v: serde_json::Value = serde_json::from_str(&json).ok()?;
        go_duration(v.get("session_ttl_min")?.as_str()?)
    })
}

/// An image reference is pinned when it names a digest, or a version tag (starting with a digit
/// or `v` and a digit, with at least a minor version): not `latest`, not missing, not `7`.
fn pinned(image: &str) -> Result<(), String> {
    if image.contains("@sha256:") {
        return Ok(());
    }
    let last = image.rsplit('/').next().unwrap_or(image);
    let Some((_, tag)) = last.split_once(':') else {
        return Err(format!("image {image:?} has no tag (that is `latest`)"));
    };
    let version = tag.strip_prefix('v').unwrap_or(tag);
    if tag == "latest"
        || !version.starts_with(|c: char| c.is_ascii_digit())
        || !version.contains('.')
    {
        return Err(format!(
            "image {image:?}: tag {tag:?} is not a pinned version (want e.g. 7.2.5)"
        ));
    }
    Ok(())
}

/// Checks the compose file alone; returns what it offers and the problems found.
fn check_compose(text: &str) -> (Compose, Vec<String>) {
    let mut problems = Vec::new();
    let mut compose = Compose::default();
    let doc = match load(text, COMPOSE) {
        Ok(d) => d,
        Err(e) => return (compose, vec![e]),
    };
    let Some(services) = doc["services"].as_hash() else {
        return (compose, vec![format!("{COMPOSE}: no services")]);
    };
    let mut found: BTreeMap<&'static str, &Yaml> = BTreeMap::new();
    for (name, service) in services {
        let name = scalar(name).unwrap_or_default();
        let image = service["image"].as_str().unwrap_or_default();
        if image.is_empty() {
            problems.push(format!("service {name}: no image"));
        } else if let Err(e) = pinned(image) {
            problems.push(format!("service {name}: {e}"));
        }
        let hc = &service["healthcheck"];
        let disabled = hc["disable"].as_bool() == Some(true)
            || hc["test"]
                .as_vec()
                .and_then(|t| t.first())
                .and_then(Yaml::as_str)
                == Some("NONE");
        let has_test = match &hc["test"] {
            Yaml::Array(a) => a.len() > 1,
            Yaml::String(s) => !s.trim().is_empty(),
            _ => false,
        };
        if disabled || !has_test {
            problems.push(format!("service {name}: no health check"));
        }
        let base = image
            .split('@')
            .next()
            .unwrap_or_default()
            .rsplit('/')
            .next()
            .unwrap_or_default()
            .split(':')
            .next()
            .unwrap_or_default();
        for b in Backend::ALL {
            if base == image_name(b) {
                found.insert(image_name(b), service);
                compose
                    .ports
                    .insert(image_name(b), published_ports(service));
            }
        }
    }
    for b in Backend::ALL {
        if !found.contains_key(image_name(b)) {
            problems.push(format!(
                "no {b} service (an image named {:?}): the suite reads {}",
                image_name(b),
                b.env_var()
            ));
        }
    }
    if let Some(redis) = found.get("redis") {
        let words = command_words(redis);
        for (flag, want) in [
            ("--appendonly", "yes"),
            ("--appendfsync", "always"),
            ("--maxmemory-policy", "noeviction"),
        ] {
            let got = flag_value(&words, flag);
            if got.as_deref() != Some(want) {
                problems.push(format!(
                    "redis: adapter-redis requires `{flag} {want}`, the command has {got:?}"
                ));
            }
        }
    }
    if let Some(consul) = found.get("consul") {
        let configured = consul_session_ttl_min(consul);
        if configured.is_none() {
            problems.push(
                "consul: no session_ttl_min (-hcl or CONSUL_LOCAL_CONFIG): at Consul's default of \
                 10s every expiry case waits 10 to 20 s"
                    .to_owned(),
            );
        }
        compose.consul_ttl_min = Some(configured.unwrap_or(Duration::from_secs(10)));
    }
    (compose, problems)
}

/// Checks one run of the conformance runner (`what` names it in messages) against the compose
/// file: every variable set, every backend run, every URL on a published port, a TTL Consul
/// accepts.
fn check_runner(what: &str, runner: &Runner, env: &Env, compose: &Compose) -> Vec<String> {
    let mut problems = Vec::new();
    for var in required_vars() {
        if env.get(var).is_none_or(|v| v.trim().is_empty()) {
            problems.push(format!("{what}: {var} is not set"));
        }
    }
    if let Some(ci) = env.get("CI") {
        if !(ci.eq_ignore_ascii_case("true") || ci == "1") {
            problems.push(format!(
                "{what}: CI={ci:?} (a missing backend would be skipped)"
            ));
        }
    }
    let backends = runner.backends();
    let missing: Vec<&str> = Backend::ALL
        .iter()
        .map(|b| b.name())
        .filter(|b| !backends.iter().any(|x| x == b))
        .collect();
    if !missing.is_empty() {
        problems.push(format!(
            "{what}: runs --backend {} only, not {}",
            backends.join(","),
            missing.join(",")
        ));
    }
    for b in Backend::ALL {
        let Some(url) = env.get(b.env_var()) else {
            continue;
        };
        let port = url::Url::parse(url).ok().and_then(|u| u.port());
        let published = compose
            .ports
            .get(image_name(b))
            .cloned()
            .unwrap_or_default();
        match port {
            Some(p) if published.contains(&p) => {}
            _ => problems.push(format!(
                "{what}: {}={url} is not on a port the {b} service publishes ({published:?})",
                b.env_var()
            )),
        }
    }
    let ttl = env
        .get(TTL_ENV)
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_millis);
    if let (Some(ttl), Some(min)) = (ttl, compose.consul_ttl_min) {
        if min > ttl {
            problems.push(format!(
                "{what}: Consul's session_ttl_min {min:?} is above the suite's TTL {ttl:?} \
                 ({TTL_ENV}): Consul would refuse the sessions"
            ));
        }
    }
    if env.contains_key(TTL_ENV) && ttl.is_none() {
        problems.push(format!("{what}: {TTL_ENV} is not a number of milliseconds"));
    }
    problems
}

/// Checks the command in the compose file's header comment: its indented lines (`#   ...`),
/// read as shell; the prose around them is not.
fn check_header(text: &str, compose: &Compose) -> Vec<String> {
    let header: String = text
        .lines()
        .take_while(|l| l.trim_start().starts_with('#') || l.trim().is_empty())
        .map(|l| l.trim_start().trim_start_matches('#'))
        .filter(|l| l.starts_with("   "))
        .map(|l| format!("{}\n", l.trim()))
        .collect();
    match Runner::find(&header) {
        None => vec![format!(
            "{COMPOSE}: the header has no command running the conformance runner"
        )],
        Some(runner) => check_runner(&format!("{COMPOSE} header"), &runner, &runner.env, compose),
    }
}

/// Checks the example workflow against the compose file.
fn check_workflow(text: &str, compose: &Compose) -> Vec<String> {
    let mut problems = Vec::new();
    let doc = match load(text, WORKFLOW) {
        Ok(d) => d,
        Err(e) => return vec![e],
    };
    let Some(jobs) = doc["jobs"].as_hash() else {
        return vec![format!("{WORKFLOW}: no jobs")];
    };
    let global = env_map(&doc["env"]);
    let backend_vars: Vec<&str> = Backend::ALL.iter().map(|b| b.env_var()).collect();
    let (mut conformance_steps, mut workspace_steps) = (0, 0);
    for (job_name, job) in jobs {
        let job_name = scalar(job_name).unwrap_or_default();
        let mut job_env = global.clone();
        job_env.extend(env_map(&job["env"]));
        let steps = job["steps"].as_vec().cloned().unwrap_or_default();
        let mut cached = false;
        let mut junit = None;
        for (i, step) in steps.iter().enumerate() {
            let label = step["name"]
                .as_str()
                .map(str::to_owned)
                .unwrap_or_else(|| format!("step {}", i + 1));
            let what = format!("{WORKFLOW}: job {job_name}, {label:?}");
            let uses = step["uses"].as_str().unwrap_or_default();
            if uses.starts_with("Swatinem/rust-cache@")
                || (uses.starts_with("actions/cache@")
                    && step["with"]["path"]
                        .as_str()
                        .is_some_and(|p| p.contains("target")))
            {
                cached = true;
            }
            let run = step["run"].as_str().unwrap_or_default();
            let builds = run.contains("cargo ") || run.contains("scripts/test.sh");
            if builds && !cached {
                problems.push(format!("{what}: builds before any cargo cache step"));
                cached = true; // one message per job
            }
            let mut env = job_env.clone();
            env.extend(env_map(&step["env"]));
            let runner = Runner::find(run);
            let workspace = run.contains("scripts/test.sh")
                || shell_commands(run)
                    .iter()
                    .any(|w| w.windows(2).any(|p| p[0] == "cargo" && p[1] == "test"));
            if workspace {
                workspace_steps += 1;
                let mut seen = env.clone();
                for words in shell_commands(run) {
                    for w in words.iter().take_while(|w| is_assignment(w)) {
                        let (k, v) = w.split_once('=').expect("an assignment");
                        seen.insert(k.to_owned(), v.to_owned());
                    }
                }
                for var in &backend_vars {
                    if seen.get(*var).is_some_and(|v| !v.trim().is_empty()) {
                        problems.push(format!(
                            "{what}: the workspace tests see {var}, so they would use the \
                             containers and skip their restart and proxy cases"
                        ));
                    }
                }
            }
            if let Some(runner) = runner {
                conformance_steps += 1;
                let mut env = env.clone();
                env.extend(runner.env.clone());
                problems.extend(check_runner(&what, &runner, &env, compose));
                let r = Runner {
                    env,
                    args: runner.args,
                };
                match r.junit() {
                    Some(path) => junit = Some((path, what.clone())),
                    None => problems.push(format!(
                        "{what}: no JUnit report (--junit or CONFORMANCE_JUNIT)"
                    )),
                }
            }
        }
        if let Some((path, what)) = junit {
            let uploaded = steps.iter().any(|s| {
                s["uses"]
                    .as_str()
                    .is_some_and(|u| u.starts_with("actions/upload-artifact@"))
                    && s["with"]["path"]
                        .as_str()
                        .is_some_and(|p| p.lines().any(|l| l.trim() == path))
                    && s["if"].as_str().is_some_and(|c| c.contains("always()"))
            });
            if !uploaded {
                problems.push(format!(
                    "{what}: the JUnit report {path} is not uploaded with `if: always()` \
                     (actions/upload-artifact) in the same job"
                ));
            }
        }
    }
    if conformance_steps == 0 {
        problems.push(format!("{WORKFLOW}: no step runs the conformance runner"));
    }
    if workspace_steps == 0 {
        problems.push(format!(
            "{WORKFLOW}: no step runs the workspace tests (scripts/test.sh or cargo test)"
        ));
    }
    problems
}

/// Every problem of the kit, given the two files' text.
fn check_kit(compose_text: &str, workflow_text: &str) -> Vec<String> {
    let (compose, mut problems) = check_compose(compose_text);
    problems.extend(check_header(compose_text, &compose));
    problems.extend(check_workflow(workflow_text, &compose));
    problems
}

fn fixtures_dir() -> PathBuf {
    std::env::var_os("FIXTURES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures"))
}

fn read(name: &str) -> String {
    let path = fixtures_dir().join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn the_kit_runs_the_whole_suite_as_written() {
    let problems = check_kit(&read(COMPOSE), &read(WORKFLOW));
    assert!(
        problems.is_empty(),
        "the CI kit in {} has problems:\n  {}",
        fixtures_dir().display(),
        problems.join("\n  ")
    );
}

/// `text` with `from` replaced by `to`; panics if `from` is not there (so that a change to the
/// fixtures cannot turn a defect test into a test of nothing).
fn edit(text: &str, from: &str, to: &str) -> String {
    assert!(
        text.contains(from),
        "the fixture no longer contains {from:?}"
    );
    text.replacen(from, to, 1)
}

fn kit() -> (String, String) {
    (read(COMPOSE), read(WORKFLOW))
}

fn assert_reported(problems: &[String], needle: &str) {
    assert!(
        problems.iter().any(|p| p.contains(needle)),
        "expected a problem containing {needle:?}, got:\n  {}",
        problems.join("\n  ")
    );
}

/// Defect 1 of issue 15: the header's command ran the memory backend only.
#[test]
fn a_header_running_only_memory_is_reported() {
    let (compose, workflow) = kit();
    let compose = edit(
        &compose,
        "--backend memory,redis,etcd,zookeeper,consul,postgres ",
        "",
    );
    let problems = check_kit(&compose, &workflow);
    assert_reported(&problems, "header: runs --backend memory only");
}

/// Defect 2: the backend URLs were set workflow-wide, so the workspace tests hit the containers.
#[test]
fn backend_urls_for_every_step_are_reported() {
    let (compose, workflow) = kit();
    let mut moved = String::new();
    let mut workflow = workflow;
    for var in Backend::ALL.map(|b| b.env_var()) {
        let line = workflow
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{var}:")))
            .unwrap_or_else(|| panic!("the workflow sets no {var}"))
            .to_owned();
        workflow = edit(&workflow, &format!("{line}\n"), "");
        moved.push_str(&format!("  {}\n", line.trim()));
    }
    let workflow = edit(
        &workflow,
        "  CI: \"true\"\n",
        &format!("  CI: \"true\"\n{moved}"),
    );
    let problems = check_kit(&compose, &workflow);
    for var in Backend::ALL.map(|b| b.env_var()) {
        assert_reported(&problems, &format!("the workspace tests see {var}"));
    }
}

/// Defect 3: no PostgreSQL service although the suite reads FENCED_POSTGRES_URL.
#[test]
fn a_missing_postgres_service_is_reported() {
    let (compose, workflow) = kit();
    let at = compose.find("\n  postgres:\n").expect("a postgres service");
    let problems = check_kit(&compose[..=at], &workflow);
    assert_reported(&problems, "no postgres service");
    assert_reported(&problems, "FENCED_POSTGRES_URL=postgres://");
}

/// Defect 4: Consul at its default 10 s session_ttl_min, and no TTL setting for the suite.
#[test]
fn consul_at_its_default_session_ttl_min_is_reported() {
    let (compose, workflow) = kit();
    let compose = edit(
        &compose,
        "      - -hcl\n      - 'session_ttl_min = \"1s\"'\n",
        "",
    );
    let problems = check_kit(&compose, &workflow);
    assert_reported(&problems, "consul: no session_ttl_min");
    assert_reported(&problems, "session_ttl_min 10s is above the suite's TTL 2s");

    // Configured, but above the suite's TTL.
    let (compose, workflow) = kit();
    let compose = edit(
        &compose,
        "session_ttl_min = \"1s\"",
        "session_ttl_min = \"5s\"",
    );
    let problems = check_kit(&compose, &workflow);
    assert_reported(&problems, "session_ttl_min 5s is above the suite's TTL 2s");

    let (compose, workflow) = kit();
    let workflow = edit(&workflow, "CONFORMANCE_TTL_MS: \"2000\"", "");
    let compose = edit(&compose, "CONFORMANCE_TTL_MS=2000 ", "");
    let problems = check_kit(&compose, &workflow);
    assert_reported(&problems, "header: CONFORMANCE_TTL_MS is not set");
    assert_reported(
        &problems,
        "Conformance suite against the containers\": CONFORMANCE_TTL_MS is not set",
    );
}

#[test]
fn unpinned_images_missing_health_checks_and_weak_redis_flags_are_reported() {
    let (compose, workflow) = kit();
    let bad = edit(&compose, "image: redis:7.2.5", "image: redis:latest");
    assert_reported(
        &check_kit(&bad, &workflow),
        "tag \"latest\" is not a pinned version",
    );
    let bad = edit(&compose, "image: zookeeper:3.8.4", "image: zookeeper");
    assert_reported(&check_kit(&bad, &workflow), "has no tag");
    let bad = edit(
        &compose,
        "image: postgres:16.4-bookworm",
        "image: postgres:16",
    );
    assert_reported(
        &check_kit(&bad, &workflow),
        "tag \"16\" is not a pinned version",
    );
    let bad = edit(&compose, "      - always\n", "      - everysec\n");
    assert_reported(
        &check_kit(&bad, &workflow),
        "requires `--appendfsync always`",
    );
    let bad = edit(&compose, "      - noeviction\n", "      - allkeys-lru\n");
    assert_reported(
        &check_kit(&bad, &workflow),
        "requires `--maxmemory-policy noeviction`",
    );
    let bad = edit(
        &compose,
        "    healthcheck:\n      test: [\"CMD\", \"consul\", \"members\"]\n",
        "    healthcheck:\n      disable: true\n      test: [\"CMD\", \"consul\", \"members\"]\n",
    );
    assert_reported(
        &check_kit(&bad, &workflow),
        "service consul: no health check",
    );
}

#[test]
fn a_workflow_without_cache_or_junit_upload_is_reported() {
    let (compose, workflow) = kit();
    let bad = workflow.replace("      - uses: Swatinem/rust-cache@v2\n", "");
    let problems = check_kit(&compose, &bad);
    assert_reported(&problems, "job workspace, \"Workspace tests (harness-started servers)\": builds before any cargo cache step");
    assert_reported(
        &problems,
        "job conformance, \"Build the runner and its worker\": builds before any cargo cache step",
    );
    let bad = edit(
        &workflow,
        "          path: junit.xml\n",
        "          path: report.xml\n",
    );
    assert_reported(
        &check_kit(&compose, &bad),
        "the JUnit report junit.xml is not uploaded",
    );
    let bad = edit(
        &workflow,
        "      - name: Upload JUnit report\n        if: always()\n",
        "      - name: Upload JUnit report\n",
    );
    assert_reported(
        &check_kit(&compose, &bad),
        "the JUnit report junit.xml is not uploaded",
    );
}

#[test]
fn shell_commands_split_like_a_shell() {
    let cmds = shell_commands(
        "A=1 B='x y' \\\n  cargo run -- --backend a,b && echo \"q\\\"uote\"; ls | wc\n",
    );
    assert_eq!(
        cmds,
        vec![
            vec!["A=1", "B=x y", "cargo", "run", "--", "--backend", "a,b"],
            vec!["echo", "q\"uote"],
            vec!["ls"],
            vec!["wc"],
        ]
    );
    let r = Runner::find("export CI=true\nX=1 cargo run -p c --bin conformance -- --junit j.xml")
        .expect("a runner");
    assert_eq!(r.env.get("CI").map(String::as_str), Some("true"));
    assert_eq!(r.env.get("X").map(String::as_str), Some("1"));
    assert_eq!(r.backends(), vec!["memory"]);
    assert_eq!(r.junit().as_deref(), Some("j.xml"));
    assert_eq!(go_duration("1s"), Some(Duration::from_secs(1)));
    assert_eq!(go_duration("500ms"), Some(Duration::from_millis(500)));
    assert_eq!(go_duration("10"), None);
}
