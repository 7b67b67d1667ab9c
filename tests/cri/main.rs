//! `bulkhead-cri-check`: what the kubelet does to a node's containerd, through containerd's CRI
//! plugin (CRI `runtime.v1`, the `k8s-cri` bindings over gRPC on a Unix socket), with the runtime
//! handler `bulkhead`: two pods with host networking (no CNI), two containers in the first and
//! one in the second, `ExecSync` into each, then `StopPodSandbox` + `RemovePodSandbox`.
//!
//!   bulkhead-cri-check [SOCKET IMAGE]
//!
//! SOCKET defaults to `$CONTAINER_RUNTIME_ENDPOINT` (without its `unix://`), IMAGE to
//! `$BULKHEAD_DEMO_IMAGE` (what `scripts/containerd-demo.sh --cri` sets). It first waits until
//! the CRI plugin lists IMAGE and `$BULKHEAD_DEMO_SANDBOX_IMAGE` (when set). IMAGE runs `sleep`; the
//! pod sandbox image is containerd's configured one. Prints one line per
//! finding, for the guest test that runs it in the test host (`tests/guest/shim.rs`, through
//! `scripts/containerd-demo.sh --cri`):
//!
//! ```text
//! version: containerd v1
//! boot: a1=<guest boot id> a2=<...> b1=<...>
//! kernel: <a1's uname -r>
//! exec: code=3 stdout=out stderr=err
//! update: ok=true memory.max=<bytes> cpu.max=150000 100000 cpu.weight=20
//! update-below-ram: refused
//! vmms: running=2 after=0
//! ```
//!
//! The pods' cgroup parent is [`CGROUP_PARENT`], so each pod VM has a host cgroup
//! (`<CGROUP_PARENT>/<pod id>`); `update:` is `UpdateContainerResources` of a1 (1 GiB, a quota of
//! 1.5 CPUs, 512 shares) and what the pod VM's cgroup v2 files say after it, `update-below-ram:`
//! the same with 64 MiB, below the guest's RAM (`refused` when the error says it cannot shrink).
//!
//! The VMMs are counted on this host: `bulkhead-vmm` processes whose parent is a
//! `containerd-shim-bulkhead-v2`. Exits non-zero, naming the call, when one fails.

use std::error::Error;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use k8s_cri::v1::image_service_client::ImageServiceClient;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use k8s_cri::v1::{
    ContainerConfig, ContainerMetadata, CreateContainerRequest, ExecSyncRequest, ImageSpec,
    ImageStatusRequest, LinuxContainerResources, LinuxPodSandboxConfig,
    LinuxSandboxSecurityContext, NamespaceMode, NamespaceOption, PodSandboxConfig,
    PodSandboxMetadata, RemovePodSandboxRequest, RunPodSandboxRequest, StartContainerRequest,
    StopPodSandboxRequest, UpdateContainerResourcesRequest, VersionRequest,
};
use tonic::transport::{Channel, Endpoint, Uri};

type Client = RuntimeServiceClient<Channel>;
type Fallible<T> = Result<T, Box<dyn Error>>;

/// The runtime handler containerd's configuration maps to `io.containerd.bulkhead.v2`.
const HANDLER: &str = "bulkhead";
/// The pods' cgroup parent (cgroupfs form: each pod sandbox's cgroup is `<parent>/<pod id>`).
const CGROUP_PARENT: &str = "/bulkhead-cri-check";
/// Where the cgroup v2 hierarchy is mounted.
const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// How long the whole check may take: pod starts boot VMs in the nested test host.
const PATIENCE: Duration = Duration::from_secs(400);

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    if args.is_empty() {
        let endpoint = std::env::var("CONTAINER_RUNTIME_ENDPOINT").unwrap_or_default();
        let socket = endpoint
            .strip_prefix("unix://")
            .unwrap_or(&endpoint)
            .to_owned();
        args = vec![
            socket,
            std::env::var("BULKHEAD_DEMO_IMAGE").unwrap_or_default(),
        ];
    }
    let [socket, image] = &args[..] else {
        eprintln!("usage: bulkhead-cri-check [SOCKET IMAGE]");
        std::process::exit(2);
    };
    if socket.is_empty() || image.is_empty() {
        eprintln!("bulkhead-cri-check: no SOCKET and IMAGE given nor in the environment");
        std::process::exit(2);
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let outcome = runtime.block_on(async {
        tokio::time::timeout(PATIENCE, check(PathBuf::from(socket), image)).await
    });
    match outcome {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            eprintln!("bulkhead-cri-check: {e}");
            std::process::exit(1);
        }
        Err(_) => {
            eprintln!("bulkhead-cri-check: not done within {PATIENCE:?}");
            std::process::exit(1);
        }
    }
}

/// A gRPC channel over the Unix socket `path` (the URI is only a placeholder).
async fn channel(path: PathBuf) -> Fallible<Channel> {
    let channel = Endpoint::try_from("http://localhost")?
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(TokioIo::new(stream))
            }
        }))
        .await?;
    Ok(channel)
}

/// Waits (up to 60 s) until the CRI plugin lists each of `images`: it learns of imported images
/// from containerd's events, so a pod started right after an import could find no sandbox
/// image and try to pull it (no registry is reachable here).
async fn wait_for_images(channel: Channel, images: &[&str]) -> Fallible<()> {
    let mut service = ImageServiceClient::new(channel);
    let deadline = Instant::now() + Duration::from_secs(60);
    for image in images {
        loop {
            let request = ImageStatusRequest {
                image: Some(ImageSpec {
                    image: (*image).to_owned(),
                    ..Default::default()
                }),
                verbose: false,
            };
            let status = call("ImageStatus", service.image_status(request).await)?;
            if status.image.is_some() {
                break;
            }
            if Instant::now() > deadline {
                return Err(format!("the CRI plugin does not list {image} after 60 s").into());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    Ok(())
}

/// Names a failed call in its error.
fn call<T>(what: &str, result: Result<tonic::Response<T>, tonic::Status>) -> Fallible<T> {
    result
        .map(tonic::Response::into_inner)
        .map_err(|s| format!("{what}: {} ({:?})", s.message(), s.code()).into())
}

async fn check(socket: PathBuf, image: &str) -> Fallible<()> {
    let channel = channel(socket).await?;
    let sandbox_image = std::env::var("BULKHEAD_DEMO_SANDBOX_IMAGE").unwrap_or_default();
    let images: Vec<&str> = [image, sandbox_image.as_str()]
        .into_iter()
        .filter(|i| !i.is_empty())
        .collect();
    wait_for_images(channel.clone(), &images).await?;
    let mut cri = RuntimeServiceClient::new(channel);
    let version = call("Version", cri.version(VersionRequest::default()).await)?;
    println!(
        "version: {} {}",
        version.runtime_name, version.runtime_api_version
    );
    let (pod_a, config_a) = run_pod(&mut cri, "a").await?;
    let (pod_b, config_b) = run_pod(&mut cri, "b").await?;
    let a1 = start_container(&mut cri, (&pod_a, &config_a), "a1", image).await?;
    let a2 = start_container(&mut cri, (&pod_a, &config_a), "a2", image).await?;
    let b1 = start_container(&mut cri, (&pod_b, &config_b), "b1", image).await?;
    let boot_id = ["cat", "/proc/sys/kernel/random/boot_id"];
    let mut boots = Vec::new();
    for id in [&a1, &a2, &b1] {
        boots.push(exec(&mut cri, id, &boot_id).await?.stdout);
    }
    println!(
        "boot: a1={} a2={} b1={}",
        text(&boots[0]),
        text(&boots[1]),
        text(&boots[2])
    );
    let kernel = exec(&mut cri, &a1, &["uname", "-r"]).await?;
    println!("kernel: {}", text(&kernel.stdout));
    let failing = exec(
        &mut cri,
        &a2,
        &["sh", "-c", "echo out; echo err >&2; exit 3"],
    )
    .await?;
    println!(
        "exec: code={} stdout={} stderr={}",
        failing.exit_code,
        text(&failing.stdout),
        text(&failing.stderr)
    );
    update(&mut cri, &pod_a, &a1).await?;
    let running = pod_vmms();
    for pod in [&pod_a, &pod_b] {
        let stop = StopPodSandboxRequest {
            pod_sandbox_id: pod.clone(),
        };
        call("StopPodSandbox", cri.stop_pod_sandbox(stop).await)?;
        let remove = RemovePodSandboxRequest {
            pod_sandbox_id: pod.clone(),
        };
        call("RemovePodSandbox", cri.remove_pod_sandbox(remove).await)?;
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while pod_vmms() > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!("vmms: running={running} after={}", pod_vmms());
    Ok(())
}

/// RunPodSandbox of pod `name` with the host's network (no CNI on the test host).
async fn run_pod(cri: &mut Client, name: &str) -> Fallible<(String, PodSandboxConfig)> {
    let config = PodSandboxConfig {
        metadata: Some(PodSandboxMetadata {
            name: format!("pod-{name}"),
            uid: format!("uid-{name}"),
            namespace: "default".into(),
            attempt: 0,
        }),
        hostname: format!("pod-{name}"),
        linux: Some(LinuxPodSandboxConfig {
            cgroup_parent: CGROUP_PARENT.into(),
            security_context: Some(LinuxSandboxSecurityContext {
                namespace_options: Some(NamespaceOption {
                    network: NamespaceMode::Node.into(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    let request = RunPodSandboxRequest {
        config: Some(config.clone()),
        runtime_handler: HANDLER.into(),
    };
    let pod = call("RunPodSandbox", cri.run_pod_sandbox(request).await)?;
    Ok((pod.pod_sandbox_id, config))
}

/// CreateContainer + StartContainer of `name` (`sleep`) in pod `pod`; returns its id.
async fn start_container(
    cri: &mut Client,
    (pod, pod_config): (&str, &PodSandboxConfig),
    name: &str,
    image: &str,
) -> Fallible<String> {
    let config = ContainerConfig {
        metadata: Some(ContainerMetadata {
            name: name.into(),
            attempt: 0,
        }),
        image: Some(ImageSpec {
            image: image.into(),
            ..Default::default()
        }),
        command: vec!["sleep".into(), "1000".into()],
        ..Default::default()
    };
    let request = CreateContainerRequest {
        pod_sandbox_id: pod.into(),
        config: Some(config),
        sandbox_config: Some(pod_config.clone()),
    };
    let created = call("CreateContainer", cri.create_container(request).await)?;
    let start = StartContainerRequest {
        container_id: created.container_id.clone(),
    };
    call("StartContainer", cri.start_container(start).await)?;
    Ok(created.container_id)
}

/// UpdateContainerResources of container `id` (of pod `pod`): 1 GiB, then 64 MiB; prints the pod
/// VM's cgroup files after the first and whether the second was refused.
async fn update(cri: &mut Client, pod: &str, id: &str) -> Fallible<()> {
    let request = |memory: i64| UpdateContainerResourcesRequest {
        container_id: id.into(),
        linux: Some(LinuxContainerResources {
            cpu_period: 100_000,
            cpu_quota: 150_000,
            cpu_shares: 512,
            memory_limit_in_bytes: memory,
            ..Default::default()
        }),
        ..Default::default()
    };
    let updated = cri.update_container_resources(request(1 << 30)).await;
    if let Err(e) = &updated {
        eprintln!("UpdateContainerResources: {e}");
    }
    let cgroup = PathBuf::from(format!("{CGROUP_ROOT}{CGROUP_PARENT}/{pod}"));
    let read = |file: &str| {
        std::fs::read_to_string(cgroup.join(file))
            .map(|text| text.trim().to_owned())
            .unwrap_or_else(|e| format!("({e})"))
    };
    println!(
        "update: ok={} memory.max={} cpu.max={} cpu.weight={}",
        updated.is_ok(),
        read("memory.max"),
        read("cpu.max"),
        read("cpu.weight")
    );
    let below = cri.update_container_resources(request(64 << 20)).await;
    let verdict = match below {
        Ok(_) => "accepted".to_owned(),
        Err(e) if e.message().contains("cannot shrink") => "refused".to_owned(),
        Err(e) => format!("failed: {e}"),
    };
    println!("update-below-ram: {verdict}");
    Ok(())
}

/// ExecSync of `cmd` in container `id` (60 s timeout).
async fn exec(cri: &mut Client, id: &str, cmd: &[&str]) -> Fallible<k8s_cri::v1::ExecSyncResponse> {
    let request = ExecSyncRequest {
        container_id: id.into(),
        cmd: cmd.iter().map(|s| (*s).to_owned()).collect(),
        timeout: 60,
    };
    call("ExecSync", cri.exec_sync(request).await)
}

/// Output bytes as one trimmed line.
fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).trim().replace('\n', " ")
}

/// `bulkhead-vmm` processes whose parent is a `containerd-shim-bulkhead-v2` (its `comm` is cut
/// to 15 bytes: `containerd-shim`).
fn pod_vmms() -> usize {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 0;
    };
    entries
        .flatten()
        .filter_map(|e| stat(&e.path().join("stat")))
        .filter(|(comm, ppid)| {
            comm == "bulkhead-vmm"
                && stat(&PathBuf::from(format!("/proc/{ppid}/stat")))
                    .is_some_and(|(parent, _)| parent == "containerd-shim")
        })
        .count()
}

/// `(comm, ppid)` from a `/proc/PID/stat` (`pid (comm) state ppid ...`; comm may hold spaces).
fn stat(path: &std::path::Path) -> Option<(String, u32)> {
    let text = std::fs::read_to_string(path).ok()?;
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    let comm = text.get(open + 1..close)?.to_owned();
    let ppid = text
        .get(close + 2..)?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some((comm, ppid))
}
