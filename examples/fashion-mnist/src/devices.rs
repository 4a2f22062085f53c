//! The GPUs Burn's wgpu backend can use here (feature `wgpu`): the Vulkan adapters, as the
//! `WgpuDevice`s that select them, and the errors for none and for a wrong index.

use burn::backend::wgpu::WgpuDevice;

/// A Vulkan adapter and the device that selects it.
#[derive(Debug, Clone)]
pub struct Adapter {
    /// What Burn's wgpu backend is given for it.
    pub device: WgpuDevice,
    /// Its name and kind, as the driver says (`llvmpipe (LLVM 15.0.6, 256 bits), Cpu`).
    pub name: String,
}

/// The error when no adapter is found: what to install.
pub const NO_VULKAN: &str = "--device wgpu: no Vulkan adapter found. Install your GPU's Vulkan \
     driver, or Mesa's software one for a device without a GPU (Debian/Ubuntu: `apt-get install \
     mesa-vulkan-drivers libvulkan1`); `vulkaninfo --summary` (package vulkan-tools) lists what \
     the system sees";

/// The error for `--adapter index` past the adapters, naming them.
pub fn no_such_adapter(index: usize, adapters: &[Adapter]) -> String {
    let listed: Vec<String> = adapters
        .iter()
        .enumerate()
        .map(|(i, a)| format!("{i}: {}", a.name))
        .collect();
    format!(
        "--adapter {index}, but there are {} Vulkan adapter(s): {}",
        adapters.len(),
        listed.join("; ")
    )
}

/// The Vulkan adapters in the order wgpu lists them, each as the `WgpuDevice` that selects it
/// (the n-th discrete GPU is `DiscreteGpu(n)`, and so on; a CPU adapter is `Cpu`, the first).
pub fn wgpu_adapters() -> Vec<Adapter> {
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends: wgpu::Backends::VULKAN,
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    });
    let adapters = ready(instance.enumerate_adapters(wgpu::Backends::VULKAN));
    let mut counts = [0usize; 4];
    let mut cpu_seen = false;
    adapters
        .into_iter()
        .filter_map(|adapter| {
            let info = adapter.get_info();
            let mut next = |kind: usize| {
                counts[kind] += 1;
                counts[kind] - 1
            };
            let device = match info.device_type {
                wgpu::DeviceType::DiscreteGpu => WgpuDevice::DiscreteGpu(next(0)),
                wgpu::DeviceType::IntegratedGpu => WgpuDevice::IntegratedGpu(next(1)),
                wgpu::DeviceType::VirtualGpu => WgpuDevice::VirtualGpu(next(2)),
                // Burn selects the first CPU adapter only.
                wgpu::DeviceType::Cpu if !cpu_seen => {
                    cpu_seen = true;
                    WgpuDevice::Cpu
                }
                _ => return None,
            };
            Some(Adapter {
                device,
                name: format!("{} ({:?})", info.name, info.device_type),
            })
        })
        .collect()
}

/// The value of a future that is ready when first polled (wgpu's adapter list on native
/// platforms), polled again until it is.
fn ready<F: std::future::Future>(future: F) -> F::Output {
    let mut future = std::pin::pin!(future);
    let mut context = std::task::Context::from_waker(std::task::Waker::noop());
    loop {
        if let std::task::Poll::Ready(value) = future.as_mut().poll(&mut context) {
            return value;
        }
        std::thread::yield_now();
    }
}
