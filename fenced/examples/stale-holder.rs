//! The stale-holder demo: why a lock needs a fence.
//!
//! Worker A acquires a lease, stalls past its TTL (a stop-the-world pause); worker B acquires
//! with a larger token, claims the resource and writes; A resumes and writes with its old token.
//! The fence rejects A's write. Exits non-zero if the stale write was ever accepted.
//!
//! ```sh
//! cargo run --example stale-holder -- [--coordinator URL] [--fence URL] [--ttl-ms N] [--pause-ms N]
//! ```

use std::process::ExitCode;
use std::time::Duration;

use fenced::{Bytes, Error, KeeperOptions, LeaseOptions, LockKey, ResourceId};
use tokio::time::Instant;

struct Args {
    coordinator: String,
    fence: String,
    ttl: Duration,
    pause: Duration,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        coordinator: "memory://".into(),
        fence: String::new(),
        ttl: Duration::from_millis(600),
        pause: Duration::ZERO,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        match flag.as_str() {
            "--coordinator" | "--backend" => args.coordinator = value(&flag)?,
            "--fence" => args.fence = value(&flag)?,
            "--ttl-ms" => {
                let v = value(&flag)?;
                let ms: u64 = v.parse().map_err(|_| format!("--ttl-ms {v:?} is not a number"))?;
                args.ttl = Duration::from_millis(ms);
            }
            "--pause-ms" => {
                let v = value(&flag)?;
                let ms: u64 = v.parse().map_err(|_| format!("--pause-ms {v:?} is not a number"))?;
                args.pause = Duration::from_millis(ms);
            }
            "-h" | "--help" => {
                return Err("usage: stale-holder [--coordinator URL] [--fence URL] [--ttl-ms N] [--pause-ms N]\n\
                     defaults: --coordinator memory:// --fence memory:// --ttl-ms 600 --pause-ms 2*ttl"
                    .into())
            }
            other => return Err(format!("unknown argument {other:?} (try --help)")),
        }
    }
    if args.fence.is_empty() {
        args.fence = "memory://".into();
    }
    if args.pause.is_zero() {
        args.pause = args.ttl * 2;
    }
    if args.pause <= args.ttl {
        return Err(format!(
            "--pause-ms ({:?}) must exceed the TTL ({:?}) for the lease to expire",
            args.pause, args.ttl
        ));
    }
    Ok(args)
}

#[derive(Clone, Copy)]
struct Timeline(Instant);

impl Timeline {
    fn say(&self, who: &str, what: impl AsRef<str>) {
        println!(
            "[{:>6} ms] {who:<2} {}",
            self.0.elapsed().as_millis(),
            what.as_ref()
        );
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(msg) => {
            eprintln!("{msg}");
            return ExitCode::from(2);
        }
    };
    match run(args).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("demo failed: {e}");
            ExitCode::from(3)
        }
    }
}

/// Returns Ok(true) when the fence rejected the stale write and kept B's value.
async fn run(args: Args) -> Result<bool, Error> {
    let coord = fenced::connect(&args.coordinator).await?;
    let fence = fenced::connect_fence(&args.fence).await?;
    let key: LockKey = format!("demo/stale-holder/{}", std::process::id()).parse()?;
    let resource = ResourceId::from(&key);
    let options = LeaseOptions::new(args.ttl).operation("stale-holder-demo");
    let t = Timeline(Instant::now());
    println!(
        "stale-holder demo: coordinator {}, fence {}, TTL {:?}, A pauses {:?}\n",
        fenced::adapter::BackendUrl::parse(&args.coordinator)?,
        fenced::adapter::BackendUrl::parse(&args.fence)?,
        args.ttl,
        args.pause
    );

    // Worker A acquires and starts its work.
    let lease_a = coord.acquire(&key, &options).await?;
    let token_a = lease_a.token();
    t.say(
        "A",
        format!(
            "acquired {key} with token {token_a} (valid for {:?} by its own clock)",
            lease_a.remaining()
        ),
    );
    fence.claim(&resource, token_a).await?;
    t.say("A", format!("claimed the resource with token {token_a}, computes, then stalls (GC pause / SIGSTOP) for {:?}", args.pause));

    // Worker B waits for the key; A's lease expires while A is paused.
    let b = {
        let coord = coord.clone();
        let fence = fence.clone();
        let key = key.clone();
        let resource = resource.clone();
        let options = options.clone().wait(args.pause + args.ttl * 4);
        async move {
            let lease_b = coord.acquire(&key, &options).await?;
            let token_b = lease_b.token();
            t.say(
                "B",
                format!("acquired {key} with token {token_b} after A's lease expired"),
            );
            fence.claim(&resource, token_b).await?;
            t.say("B", format!("claimed the resource with token {token_b}"));
            fence
                .write(&resource, token_b, Bytes::from_static(b"B's result"))
                .await?;
            t.say(
                "B",
                format!("wrote \"B's result\" with token {token_b}: accepted; a keeper renews B's lease"),
            );
            fenced::keep(lease_b, KeeperOptions::new())
        }
    };
    let (lease_b, _) = tokio::join!(b, tokio::time::sleep(args.pause));
    let lease_b = lease_b?;

    // A resumes without knowing it was paused, and writes its result with its old token.
    t.say(
        "A",
        format!(
            "resumes; its lease now reports {:?}, but A's code does not look",
            lease_a.status()
        ),
    );
    let stale = fence
        .write(&resource, token_a, Bytes::from_static(b"A's stale result"))
        .await;
    let rejected = match &stale {
        Err(Error::Stale {
            presented, current, ..
        }) => {
            t.say("A", format!("writes \"A's stale result\" with token {token_a}: REJECTED (presented {presented}, newest accepted {current})"));
            true
        }
        Ok(_) => {
            t.say(
                "A",
                format!("writes with token {token_a}: ACCEPTED -- the fence failed"),
            );
            false
        }
        Err(e) => {
            t.say("A", format!("write failed for another reason: {e}"));
            return Err(stale.unwrap_err());
        }
    };
    match lease_a.release().await {
        Err(e @ Error::Lost { .. }) => t.say("A", format!("release is a no-op: {e}")),
        other => t.say("A", format!("release returned {other:?}")),
    }
    let token_b = lease_b.token();
    lease_b.release().await?;
    t.say("B", format!("released (token {token_b})"));

    let state = fence.read(&resource).await?;
    let (final_token, final_value) = state
        .as_ref()
        .and_then(|s| s.value.clone())
        .map(|(tok, v)| (Some(tok), String::from_utf8_lossy(&v).into_owned()))
        .unwrap_or((None, String::new()));
    println!(
        "\nresource value: {final_value:?} (written with token {})",
        final_token.map_or("-".into(), |t| t.to_string())
    );
    let ok = rejected && final_value == "B's result";
    if ok {
        println!("OK: the fence rejected the stale holder's write; B's result stands.");
    } else {
        println!("FAILURE: a stale write was accepted or B's result was overwritten.");
    }
    Ok(ok)
}
