// See parse_error_interceptor.h.
#include "daemon/server/parse_error_interceptor.h"

#include <fmt/format.h>
#include <google/protobuf/descriptor.h>

namespace flexkv {
namespace {

class ParseErrorInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit ParseErrorInterceptor(std::string method) : method_(std::move(method)) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::Status status = methods->GetSendStatus();
      if (status.error_code() == grpc::StatusCode::INTERNAL && status.error_message().empty()) {
        methods->ModifySendStatus(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, ParseErrorMessage(method_)));
      }
    }
    methods->Proceed();
  }

 private:
  const std::string method_;
};

class ParseErrorInterceptorFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override {
    return new ParseErrorInterceptor(info->method());
  }
};

}  // namespace

std::string ParseErrorMessage(const std::string& method) {
  // "/package.Service/Method" -> service "package.Service", method "Method".
  const size_t slash = method.rfind('/');
  const google::protobuf::MethodDescriptor* m = nullptr;
  if (slash != std::string::npos && slash > 1) {
    const auto* service =
        google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(method.substr(1, slash - 1));
    if (service != nullptr) m = service->FindMethodByName(method.substr(slash + 1));
  }
  if (m == nullptr) {
    return fmt::format("request of {} could not be parsed; expected the serialized protobuf request of that method",
                       method);
  }
  return fmt::format(
      "request could not be parsed as {}; expected that message serialized as protobuf (see {}), with valid "
      "UTF-8 in its string fields",
      m->input_type()->full_name(), m->file()->name());
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> MakeParseErrorInterceptorFactory() {
  return std::make_unique<ParseErrorInterceptorFactory>();
}

}  // namespace flexkv
